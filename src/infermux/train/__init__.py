"""Training characterization and an epoch time/energy predictor.

Measure (`loop`): a real training loop whose every minibatch is split into fetch stall,
host→device copy, forward, backward and optimizer step, adding up to the wall time. Vary
(`knobs`): loader workers, prefetch, pinned memory, persistent workers, minibatch, storage
(disk or tmpfs), core set, precision; the power mode is read everywhere and set only on a
Jetson when asked (`power`). Sweep (`profile`): a grid within a budget, each configuration a
cold and a warm pass, stored as runs of kind `train`. Predict (`predict` with `steady`,
`components`, `learned` and `covering`; `run`): every configuration's first and later epoch,
time and energy, from short profiles of a third of them.

    from infermux.train import Grid, TrainConfig, run_train_profile
    report = run_train_profile(TrainConfig(ModelSpec("resnet18"), Grid(batch=[32, 64])))
"""

from infermux.train.components import fit_components
from infermux.train.covering import choose_profiled
from infermux.train.data import DataSpec, ImageFiles, TensorFile, evict, write_synthetic
from infermux.train.knobs import Grid, Knobs
from infermux.train.loop import PHASES, PassResult, Step, Trainer, make_loader, pinned, run_pass
from infermux.train.power import PowerMode, read_power_mode, set_power_mode
from infermux.train.predict import Prediction, predict_all
from infermux.train.profile import TrainConfig, TrainReport, run_train_profile
from infermux.train.records import PassRecord
from infermux.train.run import PredictReport, run_train_predict

__all__ = [
    "PHASES",
    "DataSpec",
    "Grid",
    "ImageFiles",
    "Knobs",
    "PassRecord",
    "PassResult",
    "PowerMode",
    "PredictReport",
    "Prediction",
    "Step",
    "TensorFile",
    "TrainConfig",
    "TrainReport",
    "Trainer",
    "choose_profiled",
    "evict",
    "fit_components",
    "make_loader",
    "pinned",
    "predict_all",
    "read_power_mode",
    "run_pass",
    "run_train_predict",
    "run_train_profile",
    "set_power_mode",
    "write_synthetic",
]
