"""Profile a window of one rank's model steps: the switch `kvray_env.PROFILE_STEPS`,
"FIRST:LAST:DIR".

Every rank (also a Ray worker of a tensor/pipeline-parallel group, where no benchmark can
reach in) runs torch.profiler over its execute_model calls FIRST .. LAST - 1, counted from
the rank's first step, then writes DIR/rank{R}.txt (time per kernel and op, by device time)
and DIR/rank{R}.json (a Chrome trace).
"""

from __future__ import annotations

from pathlib import Path

import torch

import kvray_env

ENV = kvray_env.PROFILE_STEPS.name


class StepProfiler:
    def __init__(self, first: int, last: int, out_dir: Path, rank: int):
        if not 0 <= first < last:
            raise ValueError(f"{ENV}: need 0 <= FIRST < LAST, got {first}:{last}")
        self.first, self.last, self.out_dir, self.rank = first, last, out_dir, rank
        self.step = 0
        self._prof: torch.profiler.profile | None = None

    @classmethod
    def from_env(cls, rank: int) -> StepProfiler | None:
        spec = kvray_env.profile_steps()
        if not spec:
            return None
        try:
            first, last, out_dir = spec.split(":", 2)
            return cls(int(first), int(last), Path(out_dir), rank)
        except ValueError as e:
            raise ValueError(f'{ENV}={spec!r}: expected "FIRST:LAST:DIR" ({e})') from None

    def before_step(self) -> None:
        if self.step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()

    def after_step(self) -> None:
        self.step += 1
        if self.step == self.last and self._prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
            table = self._prof.key_averages().table(
                sort_by=sort, row_limit=40, max_name_column_width=70
            )
            header = f"rank {self.rank}, steps {self.first}..{self.last - 1}\n"
            (self.out_dir / f"rank{self.rank}.txt").write_text(header + table)
            self._prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}.json"))
            self._prof = None
