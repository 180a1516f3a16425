"""Re-predict stored training runs from their stored profiles, offline: the predictor's MAPE.

A `train-predict` run (e.g. of `bench/train_gpu.py` or `bench/train_cpu.py`) stores every
profiled minibatch and every validation epoch. This script feeds the stored profiles to the
current predictor again and scores it against the stored epochs, so a change of the model is
judged on real measurements of another machine without re-running them (`run.repredict`).
With two or more runs in the database the later ones are predicted with the first as the
transfer reference (as `bench/train_gpu.py` does).

    python bench/train_repredict.py gpu-train/train-gpu.db           # every run, transfer from the first
    python bench/train_repredict.py train-cpu.db --json repredict.json
    python bench/train_repredict.py train-gpu.db --method simple --rows
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from infermux.store import Store
from infermux.train.predict import mape
from infermux.train.run import repredict


def pct(v: float | None) -> str:
    return f"{v:5.1f}%" if v is not None else "    -"


def _stored_scores(store: Store, run_id: int) -> dict[str, float | None]:
    """MAPE of the predictions the run itself stored (its held-out, measured rows), %."""
    rows = store.connection.execute(
        "SELECT epoch, predicted_s, measured_s, predicted_energy_j, measured_energy_j FROM "
        "train_predictions WHERE run_id = ? AND profiled = 0 AND measured_s IS NOT NULL",
        (run_id,)).fetchall()
    out: dict[str, float | None] = {}
    for epoch in ("first", "later"):
        mine = [r for r in rows if r[0] == epoch]
        out[f"{epoch}_time"] = mape([(r[1], r[2]) for r in mine])
        out[f"{epoch}_energy"] = mape([(r[3], r[4]) for r in mine])
    return out if rows else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", help="a results database holding train-predict runs")
    parser.add_argument("--runs", default=None, help="run ids, e.g. 1,2 (default: every "
                        "training run with validation epochs)")
    parser.add_argument("--method", default="auto", choices=("auto", "simple", "learned"))
    parser.add_argument("--no-transfer", action="store_true",
                        help="predict every run on its own (no reference run)")
    parser.add_argument("--rows", action="store_true", help="print every held-out row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = {}
    with Store(Path(args.db)) as store:
        ids = ([int(r) for r in args.runs.split(",")] if args.runs else sorted(
            row[0] for row in store.connection.execute(
                "SELECT DISTINCT run_id FROM train_passes WHERE kind = 'epoch'")))
        for n, run_id in enumerate(ids):
            reference = None if (n == 0 or args.no_transfer) else ids[0]
            res = repredict(store, run_id, reference_run=reference, method=args.method)
            model = store.run(run_id)["model"]
            out[f"{run_id}:{model}"] = res
            s = res["scores"]
            stored = _stored_scores(store, run_id)
            res["stored_scores"] = stored
            if stored:
                print(f"run {run_id} {model}: as stored (the code that ran): MAPE time first/later "
                      f"{pct(stored['first_time'])} / {pct(stored['later_time'])}, energy "
                      f"{pct(stored['first_energy'])} / {pct(stored['later_energy'])}")
            print(f"run {run_id} {model}: {res['model_info'].get('chosen')}; MAPE time "
                  f"first/later {pct(s['first_time_mape_pct'])} / {pct(s['later_time_mape_pct'])},"
                  f" energy {pct(s['first_energy_mape_pct'])} / "
                  f"{pct(s['later_energy_mape_pct'])} over {s['configurations']} held-out; "
                  f"within bounds {s['first_within_bounds']} / {s['later_within_bounds']}")
            d = res.get("drift") or {}
            if d.get("range"):
                print(f"  drift: probes {d['range'][0]:.2f}-{d['range'][1]:.2f}x (noise ±"
                      f"{200 * (d.get('noise_se_log') or 0):.0f}%, 2 standard errors), resolved "
                      f"in {d.get('resolved_epochs', 0)} of {d.get('epochs', 0)} validated epochs; "
                      f"MAPE time corrected {pct(s.get('first_time_mape_drift_corrected_pct'))}"
                      f" / {pct(s.get('later_time_mape_drift_corrected_pct'))}")
            print("  profile share of the predicted epoch: " + ", ".join(
                f"{label} {share:.1%}" for label, share in res["profile_shares"].items()))
            for epoch in ("first", "later"):
                att = res["attribution"].get(epoch)
                if att is not None:
                    print(f"  {epoch} epochs: {att['verdict']} (terms: " + ", ".join(
                        f"{k} {v:.1f}%" for k, v in att["terms_abs_pct"].items()) + ")")
            if args.rows:
                for r in res["predictions"]:
                    if r["measured_s"] and not r["profiled"]:
                        e = (f" energy {r['predicted_energy_j']:7.0f} J vs "
                             f"{r['measured_energy_j']:7.0f} J "
                             f"({100 * (r['predicted_energy_j'] / r['measured_energy_j'] - 1):+5.1f}%)"
                             if r.get("predicted_energy_j") and r.get("measured_energy_j")
                             else "")
                        print(f"  {r['label']:<32} {r['epoch']:<5} {r['predicted_s']:7.2f} s "
                              f"[{r['low_s']:6.2f}, {r['high_s']:6.2f}] vs {r['measured_s']:7.2f} s "
                              f"({100 * (r['predicted_s'] / r['measured_s'] - 1):+5.1f}%){e}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
