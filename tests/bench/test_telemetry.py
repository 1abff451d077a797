"""kiln/bench/telemetry.py against scripted counters: what a timed span's summary says of the
board's energy, power, clock and clock-event reasons; and the summary table it prints."""

import itertools
import time

import pytest

from kiln.bench.report import _gpu_table
from kiln.bench.telemetry import GpuTelemetry, Sample


class ScriptedReader:
    """Counters that play a script: samples cycle through ``samples``; the energy counter
    advances ``mj_per_read`` each read (None: the board has no counter)."""

    max_sm_clock_mhz = 1980.0
    power_limit_w = 700.0

    def __init__(self, samples: list[Sample], mj_per_read: int | None = 1000) -> None:
        self._samples = itertools.cycle(samples)
        self._mj_per_read, self._energy, self.reads = mj_per_read, 5_000_000, 0

    def energy_mj(self) -> int | None:
        if self._mj_per_read is None:
            return None
        self._energy += self._mj_per_read
        return self._energy

    def sample(self) -> Sample:
        self.reads += 1
        return next(self._samples)


CAPPED = Sample(sm_clock_mhz=1400.0, power_w=700.0, power_capped=True, thermal=False)
FREE = Sample(sm_clock_mhz=1980.0, power_w=300.0, power_capped=False, thermal=False)
HOT = Sample(sm_clock_mhz=1200.0, power_w=500.0, power_capped=False, thermal=True)


def test_the_energy_counter_gives_joules_and_the_samples_the_rest():
    reader = ScriptedReader([CAPPED, FREE, CAPPED, HOT])
    with GpuTelemetry(reader, interval_s=3600) as gpu:  # no timer sample: entry and exit only
        pass
    s = gpu.summary(seconds=2.0, output_tokens=500)
    # entry and exit read the counter once each: 1000 mJ apart
    assert s["energy_j"] == pytest.approx(1.0) and s["energy_source"] == "energy counter"
    assert s["joules_per_output_token"] == pytest.approx(1.0 / 500)
    assert s["samples"] == 2  # CAPPED at entry, FREE at exit
    assert s["mean_power_w"] == pytest.approx(500.0)
    assert s["mean_sm_clock_mhz"] == pytest.approx(1690.0) and s["min_sm_clock_mhz"] == 1400.0
    assert s["max_sm_clock_mhz"] == 1980.0 and s["power_limit_w"] == 700.0
    assert s["power_capped_share"] == pytest.approx(0.5) and s["thermal_share"] == 0.0


def test_without_a_counter_energy_is_mean_power_over_the_span():
    reader = ScriptedReader([CAPPED, HOT], mj_per_read=None)
    with GpuTelemetry(reader, interval_s=3600) as gpu:
        pass
    s = gpu.summary(seconds=4.0)
    assert s["energy_source"] == "power samples"
    assert s["energy_j"] == pytest.approx(600.0 * 4.0)
    assert s["thermal_share"] == pytest.approx(0.5)
    assert "joules_per_output_token" not in s


def test_the_thread_samples_through_the_span_and_each_entry_starts_afresh():
    reader = ScriptedReader([CAPPED, FREE, HOT])
    gpu = GpuTelemetry(reader, interval_s=0.005)
    with gpu:
        time.sleep(0.2)
    first = gpu.summary(seconds=0.2)
    assert first["samples"] >= 5 and first["samples"] == reader.reads
    with gpu:  # a second case: its own samples only
        pass
    assert gpu.summary(seconds=0.01)["samples"] < first["samples"]


def test_no_reader_says_why():
    gpu = GpuTelemetry.of("cpu")
    with gpu:
        pass
    assert gpu.summary(1.0, 10) == {"available": False,
                                    "reason": "no GPU counters on a cpu device"}


def test_the_summary_table_shows_each_case():
    with GpuTelemetry(ScriptedReader([CAPPED, CAPPED]), interval_s=3600) as gpu:
        pass
    metrics = [{"case": {"batch_size": 1, "input_len": 128, "output_len": 256},
                "gpu": gpu.summary(1.0, 256)}]
    table = _gpu_table(metrics)
    assert "GPU while timed (NVML, every 3600 s)" in table  # the interval the samples had
    assert "| bs=1 in=128 out=256 | 1.0 | 0.004 | 700 (700) | 1,400 / 1,400 (1,980) | 100% | 0% |" \
        in table
    assert _gpu_table([{"case": {}}]) == ""  # results without telemetry print nothing



class FailingReader(ScriptedReader):
    """Answers ``good`` samples, then raises as a driver might."""

    def __init__(self, good: int) -> None:
        super().__init__([FREE])
        self._good = good

    def sample(self) -> Sample:
        if self.reads >= self._good:
            self.reads += 1
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return super().sample()


@pytest.mark.parametrize("good", [0, 1, 3])
def test_a_failing_sample_ends_the_sampling_not_the_run(good):
    gpu = GpuTelemetry(FailingReader(good), interval_s=0.005)
    with gpu:
        time.sleep(0.1)
    s = gpu.summary(seconds=0.1, output_tokens=10)
    if good == 0:  # not one sample: nothing to report but why
        assert s == {"available": False,
                     "reason": "sampling stopped: RuntimeError: NVML_ERROR_GPU_IS_LOST"}
    else:
        assert s["samples"] == good and s["mean_power_w"] == pytest.approx(300.0)
        assert s["error"] == "sampling stopped: RuntimeError: NVML_ERROR_GPU_IS_LOST"
