"""The energy and cost of a training run: ``EnergyMeter`` measures the energy, ``run_ledger`` adds up device-hours,
energy and money, actual (from the logbook) beside planned (from the training plan), at the prices and power of
kiln.plan.cost.CostConfig (conf/cost.yaml).

``EnergyMeter(device)`` reads NVIDIA's energy counters (NVML) of this node's GPUs on CUDA; elsewhere energy is an
estimate, ``watts_per_device`` x device-hours, and says so. ``run_ledger(rows, plan, cost)`` sums a run's attempts.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.plan.cost import CostConfig, planned_costs


class EnergyMeter:
    """Energy used by this node's training GPUs since ``start()``, from NVML's total-energy counters (millijoules
    since the driver loaded); ``joules()`` is None where there are none to read (CPU, an old GPU, no driver)."""

    def __init__(self, device: str, local_devices: int = 1):
        self.handles: list = []
        self.start_mj: list[int] = []
        if device != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [int(x) for x in visible.split(",") if x.strip().isdigit()] or list(range(pynvml.nvmlDeviceGetCount()))
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids[:local_devices]]
            self.start_mj = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]
        except Exception:  # no NVML, or a GPU without the counter: the ledger estimates instead
            self.handles, self.start_mj = [], []

    def joules(self) -> float | None:
        if not self.handles:
            return None
        try:
            import pynvml

            now = [pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]
        except Exception:
            return None
        return sum(b - a for a, b in zip(self.start_mj, now)) / 1000.0


def run_ledger(rows: list[dict[str, Any]], plan: dict[str, Any] | None, cost: CostConfig) -> dict[str, Any]:
    """Device-hours, energy and money of every attempt in ``rows`` (kiln.train.logbook.attempts), with the plan's.

    Device-hours are each attempt's wall time x its world size (redone and lost work included: it was paid for).
    Energy is measured where an attempt read NVML counters (scaled from rank 0's node to all nodes), otherwise
    ``cost.watts_per_device`` x device-hours, marked as an estimate.
    """
    device_hours = measured_kwh = estimated_kwh = 0.0
    for r in rows:
        dh = r["hours"] * r["world_size"]
        device_hours += dh
        if r.get("energy_j") is not None:
            measured_kwh += r["energy_j"] / 3.6e6
        else:
            estimated_kwh += dh * cost.watts_per_device / 1000
    basis = ("measured (NVML energy counters)" if estimated_kwh == 0 and measured_kwh > 0 else
             f"estimate ({cost.watts_per_device:g} W per device x device-hours)" if measured_kwh == 0 else
             f"measured where NVML counters were read, else {cost.watts_per_device:g} W per device (partly estimated)")
    out = {"device_hours": round(device_hours, 6), "energy_kwh": round(measured_kwh + estimated_kwh, 6),
           "energy_basis": basis, "energy_estimated": estimated_kwh > 0,
           "cost": round(device_hours * cost.price_per_device_hour, 4), "currency": cost.currency,
           "price_per_device_hour": cost.price_per_device_hour, "attempts": len(rows)}
    if plan:
        planned = planned_costs(plan, cost)
        out.update({f"planned_{k}": v for k, v in planned.items() if k in ("device_hours", "energy_kwh", "cost")})
    return out


def ledger_table(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """Planned beside actual, one row per measure (for asset metadata and the model card)."""
    rows = [{"measure": "device-hours", "planned": ledger.get("planned_device_hours"), "actual": ledger["device_hours"]},
            {"measure": "energy (kWh)", "planned": ledger.get("planned_energy_kwh"), "actual": ledger["energy_kwh"]},
            {"measure": f"cost ({ledger['currency']})", "planned": ledger.get("planned_cost"), "actual": ledger["cost"]}]
    return rows
