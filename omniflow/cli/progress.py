"""The start-up progress bar of ``omniflow up``."""

from __future__ import annotations

from rich.console import Console


class StartProgress:
    """A progress bar of actors ready; setup (weights, tiny-model builds) shows per actor."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("starting", total=total)
        self._states: dict[str, str] = {}

    def update(self, actor_id: str, state: str) -> None:
        self._states[actor_id] = state
        ready = sum(1 for s in self._states.values() if s == "ready")
        busy = [a for a, s in self._states.items() if s in ("spawned", "setup")]
        what = f"loading {', '.join(busy[:3])}" if busy else "actors ready"
        self._progress.update(self._task, completed=ready, description=what)

    def stop(self) -> None:
        self._progress.stop()

    def __enter__(self) -> StartProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


class StepCounter:
    """``denoising step k/n`` on one stderr line while a request runs (a line per step where
    stderr is not a terminal), from the outputs whose ``progress`` is
    ``{"step": k, "steps": n}`` (a diffusion role sends one per step)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.shown = False

    def update(self, progress: object) -> None:
        if not isinstance(progress, dict):
            return
        step, steps = progress.get("step"), progress.get("steps")
        if not isinstance(step, int) or not isinstance(steps, int):
            return
        what = str(progress.get("stage", "denoising"))
        if self.console.is_terminal:  # one line, rewritten in place
            self.console.file.write(f"\r{what} step {step}/{steps}")
            self.shown = True
        else:  # a log or a pipe: a line per step, which \r would run together
            self.console.file.write(f"{what} step {step}/{steps}\n")
        self.console.file.flush()

    def done(self) -> None:
        if self.shown:
            self.console.file.write("\n")
            self.console.file.flush()
            self.shown = False
