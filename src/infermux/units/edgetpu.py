"""Coral Edge TPUs: `edgetpu:N` units, found the way libedgetpu finds them.

libedgetpu (the Edge TPU runtime) opens PCIe/M.2 modules through the `apex` driver's device nodes
(`/dev/apex_0`, …; sysfs `/sys/class/apex/apex_N/device` → the PCI function, vendor 0x1ac1 device
0x089a) and USB Accelerators through libusb: before its firmware is loaded an Accelerator
enumerates as 1a6e:089a (Global Unichip Corp.), afterwards as 18d1:9302 (Google Inc.). Both ids are
read from sysfs (`/sys/bus/usb/devices/*/idVendor|idProduct`), so a tree copied from a machine
parses as the machine's own files do (tests/fixtures/edgetpu_*).

Units are numbered PCIe first, then USB, each in sysfs order; the delegate addresses them as
libedgetpu does (`pci:K`, `usb:K`). The contention domain is the link: a PCIe function has its
own, USB Accelerators on one bus share it (and a USB 2 port costs throughput). A unit is usable
when `libedgetpu.so.1` loads; otherwise it is listed with the reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any

from infermux.units.base import Unit

__all__ = ["EDGETPU_PCI_IDS", "EDGETPU_USB_IDS", "edgetpu_runtime", "edgetpu_units", "find_edgetpus"]

#: (vendor, product) of a USB Accelerator before and after its firmware is loaded.
EDGETPU_USB_IDS = {("1a6e", "089a"): "USB Accelerator (no firmware loaded yet)",
                   ("18d1", "9302"): "USB Accelerator"}
#: (vendor, device) of the PCIe/M.2 Edge TPU function.
EDGETPU_PCI_IDS = {("0x1ac1", "0x089a"): "PCIe/M.2 Accelerator"}
_LIBRARY = "libedgetpu.so.1"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def find_edgetpus(root: Path = Path("/")) -> list[dict[str, Any]]:
    """Every Edge TPU under `root`: PCIe functions (apex nodes) first, then USB devices."""
    found: list[dict[str, Any]] = []
    seen_pci: set[str] = set()
    for node in sorted((root / "sys/class/apex").glob("apex_*")):
        device = node / "device"
        pci = device.resolve().name if device.exists() else ""
        seen_pci.add(pci)
        dev_node = root / "dev" / node.name
        found.append({
            "bus": "pci", "name": "PCIe/M.2 Accelerator", "sysfs": node.name, "pci": pci,
            "dev_node": f"/dev/{node.name}", "dev_node_present": dev_node.exists(),
            "temp_millic": _read(node / "temp") or None,
            "link": pci or node.name,
        })
    for dev in sorted((root / "sys/bus/pci/devices").glob("*")):
        ids = (_read(dev / "vendor"), _read(dev / "device"))
        if ids in EDGETPU_PCI_IDS and dev.name not in seen_pci:
            # The function is there, the apex driver is not bound: libedgetpu cannot open it.
            found.append({"bus": "pci", "name": EDGETPU_PCI_IDS[ids], "pci": dev.name,
                          "dev_node": "", "dev_node_present": False, "link": dev.name,
                          "problem": "the apex driver is not loaded (no /dev/apex_* node): install "
                                     "gasket-dkms and reboot, or modprobe apex"})
    for dev in sorted((root / "sys/bus/usb/devices").glob("*")):
        ids = (_read(dev / "idVendor").lower(), _read(dev / "idProduct").lower())
        if ids not in EDGETPU_USB_IDS:
            continue
        speed = _read(dev / "speed")
        found.append({
            "bus": "usb", "name": EDGETPU_USB_IDS[ids], "sysfs": dev.name,
            "usb_id": ":".join(ids), "busnum": _read(dev / "busnum"), "devnum": _read(dev / "devnum"),
            "speed_mbps": int(speed) if speed.isdigit() else None,
            "manufacturer": _read(dev / "manufacturer"), "product": _read(dev / "product"),
            "link": f"usb{_read(dev / 'busnum') or dev.name.split('-')[0]}",
        })
    return found


def edgetpu_runtime() -> tuple[bool, str]:
    """Whether libedgetpu loads here, and why not."""
    name = ctypes.util.find_library("edgetpu") or _LIBRARY
    try:
        ctypes.CDLL(name)
    except OSError:
        return False, (f"the Edge TPU runtime ({_LIBRARY}) is not installed: apt-get install "
                       "libedgetpu1-std from Coral's package repository")
    return True, ""


def edgetpu_units(notes: list[str], root: Path = Path("/"),
                  runtime: tuple[bool, str] | None = None) -> list[Unit]:
    """One `edgetpu:N` unit per device found; a note says why there is none."""
    devices = find_edgetpus(root)
    if not devices:
        notes.append("edgetpu: no Edge TPU found (no /dev/apex_* node or PCI function 1ac1:089a, "
                     "no USB device 1a6e:089a or 18d1:9302)")
        return []
    ok, why = runtime if runtime is not None else edgetpu_runtime()
    units: list[Unit] = []
    per_bus = {"pci": 0, "usb": 0}
    for index, device in enumerate(devices):
        bus = device["bus"]
        delegate = f"{bus}:{per_bus[bus]}"
        per_bus[bus] += 1
        problem = device.get("problem", "")
        if bus == "pci" and not problem and not device["dev_node_present"]:
            problem = f"{device['dev_node']} is missing: load the apex driver (modprobe apex)"
        if bus == "usb" and device.get("speed_mbps") == 480:
            notes.append(f"edgetpu:{index}: the USB Accelerator runs at USB 2 speed (480 Mb/s): "
                         "a USB 3 port transfers inputs several times faster")
        reason = problem or why
        units.append(Unit(
            id=f"edgetpu:{index}", kind="edgetpu", device=f"edgetpu:{index}", mode="int8",
            name=f"Coral Edge TPU {device['name']}",
            contention_domain=f"{bus}:{device['link']}",
            available=ok and not problem, reason=reason,
            details={**device, "delegate_device": delegate},
        ))
    if not ok:
        notes.append(f"edgetpu: {len(devices)} Edge TPU(s) found but unusable: {why}")
    return units
