"""Real speech for tests and demos, synthesized offline with espeak-ng and resampled to 16 kHz."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

SAMPLE_RATE = 16000


def synthesize(text: str, out_path: str | Path, voice: str = "en-us", words_per_minute: int = 160) -> Path:
    """Speak ``text`` with espeak-ng into a 16 kHz mono 16-bit WAV at ``out_path``."""
    import numpy as np
    import soundfile as sf
    from scipy.signal import resample_poly

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed; run `make setup` (or apt-get install -y espeak-ng)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(raw), text],
            check=True,
            capture_output=True,
        )
        audio, rate = sf.read(str(raw), dtype="float32")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    gcd = int(np.gcd(rate, SAMPLE_RATE))
    audio = resample_poly(audio, SAMPLE_RATE // gcd, rate // gcd).astype("float32")
    sf.write(str(out_path), audio, SAMPLE_RATE, subtype="PCM_16")
    return out_path
