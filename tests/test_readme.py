"""The README's examples, run as written, print what the README shows.

Every code block the README heads with `<!-- example: NAME -->` is run — a `python` block with this interpreter, a
`bash` block with bash — against a server started as `make run` starts it (`deltaserve serve`, every flag at its
default); the block the README heads with `<!-- output: NAME -->` is its exact standard output. The examples talk to
http://127.0.0.1:8000 as the README says; the test's server listens on a free port, which replaces 8000.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import REPO, run_server

README = REPO / "README.md"
BLOCK = re.compile(r"<!-- (example|output): ([\w-]+) -->\n```(\w*)\n(.*?)\n```", re.S)


def blocks() -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    examples, outputs = {}, {}
    for kind, name, lang, body in BLOCK.findall(README.read_text(encoding="utf-8")):
        if kind == "example":
            examples[name] = (lang, body)
        else:
            outputs[name] = body
    return examples, outputs


def test_every_example_shows_its_output():
    examples, outputs = blocks()
    assert len(examples) >= 3, examples
    assert set(examples) == set(outputs), (sorted(examples), sorted(outputs))
    assert all(lang in ("python", "bash") for lang, _ in examples.values())


@pytest.fixture(scope="module")
def server():
    with run_server(None) as s:  # no model argument: the embedded default model, as `make run` serves it
        yield s


@pytest.mark.parametrize("name", sorted(blocks()[0]))
def test_example_prints_what_the_readme_shows(server, name, tmp_path):
    examples, outputs = blocks()
    lang, code = examples[name]
    port = server.url.rsplit(":", 1)[1]
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    script = tmp_path / ("example.py" if lang == "python" else "example.sh")
    script.write_text(code + "\n", encoding="utf-8")
    runner = [sys.executable] if lang == "python" else ["bash", "-euo", "pipefail"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([*runner, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == outputs[name], done.stdout
