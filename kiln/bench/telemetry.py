"""What the GPU did while a benchmark was timed: energy, power, SM clock and why it was held down.

An H100 running a large batch sits at its power limit, and the SM clock the driver grants under
it, not the datasheet's, sets what the tensor cores deliver: 512 x 512/256 on Llama-3.1-8B holds
700 W with the clock at ~1,400 MHz of 1,980 through its prompt steps
(benchmarks/results/h100/check_1de0795.txt). The same tree then measures a few percent apart on
two machines, and the difference shows here, not in the kernels. So every timed run also
records, through NVML (NVIDIA's management library, via nvidia-ml-py):

- the energy the board used, from its energy counter (or power samples where it has none), and
  with it joules per output token;
- power, SM clock and the driver's clock-event reasons sampled every ``interval_s``: the share
  of samples held at the power cap, and at a thermal or hardware slowdown.

Where NVML is missing (no driver, a CPU run, nvidia-ml-py not installed) the result says why
instead: a benchmark never fails for want of telemetry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

SAMPLE_INTERVAL_S = 0.1


@dataclass(frozen=True)
class Sample:
    sm_clock_mhz: float
    power_w: float
    power_capped: bool  # the driver holds the clock down to stay under the power limit
    thermal: bool  # ... or for temperature, or a hardware slowdown signal


class Reader(Protocol):
    """One GPU's counters (NvmlReader; tests pass scripted ones)."""

    max_sm_clock_mhz: float
    power_limit_w: float

    def energy_mj(self) -> int | None: ...  # millijoules since the driver loaded; None: no counter

    def sample(self) -> Sample: ...


class NvmlReader:
    """The counters of the GPU behind a torch device, matched to NVML's by UUID (so that
    CUDA_VISIBLE_DEVICES' renumbering cannot point at another board)."""

    def __init__(self, device: torch.device) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                   for i in range(pynvml.nvmlDeviceGetCount())]
        matches = [h for h in handles
                   if str(pynvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-") == uuid]
        if not matches:
            raise RuntimeError(f"no NVML device has the UUID of cuda:{index} ({uuid})")
        self._handle = matches[0]
        self.max_sm_clock_mhz = float(
            pynvml.nvmlDeviceGetMaxClockInfo(self._handle, pynvml.NVML_CLOCK_SM))
        self.power_limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000
        self._cap = pynvml.nvmlClocksEventReasonSwPowerCap
        self._thermal = (pynvml.nvmlClocksEventReasonSwThermalSlowdown
                         | pynvml.nvmlClocksEventReasonHwSlowdown
                         | pynvml.nvmlClocksEventReasonHwThermalSlowdown
                         | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown)

    def energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except self._nvml.NVMLError:  # boards before Volta have no counter
            return None

    def sample(self) -> Sample:
        nvml, h = self._nvml, self._handle
        reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        return Sample(sm_clock_mhz=float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                      power_w=nvml.nvmlDeviceGetPowerUsage(h) / 1000,
                      power_capped=bool(reasons & self._cap),
                      thermal=bool(reasons & self._thermal))


def open_reader(device: torch.device | str) -> tuple[Reader | None, str | None]:
    """(reader, None), or (None, why there is none)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no GPU counters on a {device.type} device"
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        reader = NvmlReader(device)
        reader.sample()  # a board that lacks a query fails here, not in the timed span
        return reader, None
    except Exception as exc:  # NVML raises its own error class per failure; all mean "none"
        return None, f"NVML: {type(exc).__name__}: {exc}"


class GpuTelemetry:
    """Samples a reader on a background thread between ``with`` entry and exit; ``summary``
    then describes the span. The thread reads counters only: it adds no work to the GPU."""

    def __init__(self, reader: Reader | None, unavailable: str | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._reader, self._why = reader, unavailable
        self._interval_s = interval_s
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy: tuple[int | None, int | None] = (None, None)
        self._error: str | None = None

    @classmethod
    def of(cls, device: torch.device | str, interval_s: float = SAMPLE_INTERVAL_S
           ) -> GpuTelemetry:
        return cls(*open_reader(device), interval_s=interval_s)

    def __enter__(self) -> GpuTelemetry:
        if self._reader is not None:
            self._samples, self._stop, self._error = [], threading.Event(), None
            self._energy = (self._reader.energy_mj(), None)
            self._sample()
            self._thread = threading.Thread(target=self._run, name="kiln-gpu-telemetry",
                                            daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> bool:
        """One more sample; False once the reader fails (the error is kept for the summary)."""
        if self._error is not None:
            return False
        try:
            self._samples.append(self._reader.sample())
        except Exception as exc:  # a driver hiccup ends the sampling, never the run
            self._error = f"sampling stopped: {type(exc).__name__}: {exc}"
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s) and self._sample():
            pass

    def __exit__(self, *exc: object) -> None:
        if self._reader is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        self._energy = (self._energy[0], self._reader.energy_mj())

    def summary(self, seconds: float, output_tokens: int | None = None) -> dict[str, Any]:
        """The span's figures; ``seconds`` is its timed length (energy from power samples
        needs it where the board has no counter)."""
        if self._reader is None:
            return {"available": False, "reason": self._why}
        samples = self._samples
        n = len(samples)
        if n == 0:
            return {"available": False, "reason": self._error}
        mean_power = sum(s.power_w for s in samples) / n
        start, end = self._energy
        if start is not None and end is not None:
            energy_j, source = (end - start) / 1000, "energy counter"
        else:
            energy_j, source = mean_power * seconds, "power samples"
        clocks = [s.sm_clock_mhz for s in samples]
        out = {
            "available": True, "samples": n, "interval_s": self._interval_s,
            "energy_j": energy_j, "energy_source": source,
            "mean_power_w": mean_power, "power_limit_w": self._reader.power_limit_w,
            "mean_sm_clock_mhz": sum(clocks) / n, "min_sm_clock_mhz": min(clocks),
            "max_sm_clock_mhz": self._reader.max_sm_clock_mhz,
            "power_capped_share": sum(s.power_capped for s in samples) / n,
            "thermal_share": sum(s.thermal for s in samples) / n,
        }
        if output_tokens:
            out["joules_per_output_token"] = energy_j / output_tokens
        if self._error is not None:
            out["error"] = self._error
        return out
