"""What ``omniflow send`` does with a request's outputs: text to the terminal, files to --out.

Images arrive as PNG bytes (``image``); audio arrives as a stream of raw PCM16 mono chunks
(``audio_chunk`` with ``sample_rate``), assembled into one WAV when the request ends.
"""

from __future__ import annotations

import sys
import wave
from pathlib import Path
from typing import Any


class OutputWriter:
    def __init__(self, out_dir: Path, request_id: str, echo: bool = True) -> None:
        self.out_dir = out_dir
        self.request_id = request_id
        self.echo = echo
        self.text = ""
        self.outputs: list[dict[str, Any]] = []
        self.files: list[str] = []
        self.made: set[str] = set()  # the kinds written: "image", "audio"
        self._audio: list[bytes] = []
        self._rate = 0
        self._images = 0
        self._steps: Any = None  # a StepCounter, once some output reports progress

    def add(self, event: Any) -> None:
        data = event.data
        self.outputs.append(
            {
                "role": event.role,
                "seq": event.seq,
                "data": {k: _describe(v) for k, v in data.items()},
                "tensors": {k: list(v.shape) for k, v in event.tensors.items()},
            }
        )
        if "progress" in data and self.echo:
            if self._steps is None:
                from omniflow.cli.progress import StepCounter

                self._steps = StepCounter()
            self._steps.update(data["progress"])
        if isinstance(data.get("text"), str):
            self.text += data["text"]
            if self.echo:
                sys.stdout.write(data["text"])
                sys.stdout.flush()
        if isinstance(data.get("image"), bytes):
            self._images += 1
            self.made.add("image")
            self._write(f"image-{self.request_id[:12]}-{self._images}.png", data["image"])
        if isinstance(data.get("audio_chunk"), bytes):
            self._audio.append(data["audio_chunk"])
            self._rate = int(data.get("sample_rate", 24000))

    def finish(self) -> None:
        if self._steps is not None:
            self._steps.done()
        if not self._audio:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"audio-{self.request_id[:12]}.wav"
        with wave.open(str(path), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(self._rate)
            for chunk in self._audio:
                f.writeframes(chunk)
        self.files.append(str(path))
        self.made.add("audio")
        self._audio = []

    def _write(self, name: str, data: bytes) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / name
        path.write_bytes(data)
        self.files.append(str(path))


def _describe(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    return value
