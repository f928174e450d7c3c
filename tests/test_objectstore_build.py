"""``infra/objectstore/build.sh`` says where a cold build is instead of printing hundreds of ``go: downloading`` lines
and then nothing for minutes: a line when it starts, one every ``KAPPA_BUILD_HEARTBEAT`` s with the modules
downloaded so far, one when it is done; a failed build shows go's output (its download lines aside) and one error line.

A cold build of the real SeaweedFS takes 3-13 minutes here, beyond a test's budget (``make objectstore-build`` runs
it for real, once per machine): the ``go`` on ``PATH`` here is a stand-in that behaves like a slow one - it prints
download lines, takes a few seconds and writes the binary, or fails. What is tested is the script's reporting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FAKE_GO = """#!/usr/bin/env bash
if [[ "$1" == mod ]]; then mkdir -p "$FAKE_SRC"; echo "{\\"Dir\\": \\"$FAKE_SRC\\"}"; exit 0; fi
for i in 1 2 3; do echo "go: downloading example.com/m$i v1.0.0" >&2; done
if [[ -n "${FAKE_FAIL:-}" ]]; then echo "weed/x.go:1:1: syntax error" >&2; exit 1; fi
sleep 5
out=""; while [[ $# -gt 0 ]]; do [[ "$1" == -o ]] && out="$2"; shift; done
printf '#!/bin/sh\\n' > "$out"; chmod +x "$out"
"""


def _build(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "go").write_text(_FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "infra" / "objectstore" / "build.sh")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                            "KAPPA_TOOLS_CACHE": str(tmp_path / "cache"),
                                            "FAKE_SRC": str(tmp_path / "src"), "KAPPA_BUILD_HEARTBEAT": "2", **env})


def test_a_cold_build_says_where_it_is_and_not_every_module(tmp_path):
    done = _build(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[1].startswith("objectstore-build: building weed ") and "a line every" in lines[1], lines
    beats = [line for line in lines if line.startswith("objectstore-build: still building weed: ")]
    assert beats and all(line.endswith("s, 3 Go modules downloaded, compiling") for line in beats), lines
    assert lines[-1].startswith("objectstore-build: built weed in "), lines
    assert not any("go: downloading" in line for line in lines), lines
    weed = Path(done.stdout.strip()) / "weed"
    assert weed.is_file() and os.access(weed, os.X_OK)
    again = _build(tmp_path)  # warm: at once, nothing said
    assert again.returncode == 0 and again.stderr == "" and again.stdout == done.stdout


def test_a_failed_build_shows_gos_output_and_one_error_line(tmp_path):
    failed = _build(tmp_path, FAKE_FAIL="1")
    assert failed.returncode == 1
    lines = failed.stderr.splitlines()
    assert "weed/x.go:1:1: syntax error" in lines and not any("go: downloading" in line for line in lines), lines
    assert lines[-1] == "objectstore-build: error: go build of weed failed (above)", lines
