"""The Dockerfile's install step, checked without a Docker engine: run as plain shell into a throw-away
virtualenv. (What docker-compose.yml and the Dockerfile say: ``tests/unit/test_compose.py``.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repofiles import ROOT, dockerfile_instructions


@pytest.mark.skipif(shutil.which("python3") is None, reason="needs python3 to make a virtualenv")
def test_the_dockerfile_install_step_gives_a_working_redpacket(tmp_path: Path) -> None:
    """The image's build, as plain shell: exactly what the COPY lines bring, installed by pip into a new
    environment the way the RUN line does, then the command run from outside the source tree."""
    context = tmp_path / "app"
    context.mkdir()
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            *sources, dest = rest.split()
            for source in sources:
                target = context / (source if dest in ("./", ".") else dest)
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:  # (a COPY makes the folders its destination names)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / source, target)
    # pip builds the wheel from that context (build isolation, as in the image); the dependencies are
    # this test run's own, so nothing more is downloaded.
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # A new environment with its own pip (never this run's pip: it would swap out this run's install).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            *map(str, wheels.glob("*.whl")),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": ":".join(deps)}
    # Every module of the system and of the Python client it reads the protocol from imports from the
    # installed copy (the tools need their extra; __main__ runs the command): a package the wheel left out
    # fails here, not when the image's hub or worker starts.
    probe = (
        "import importlib, pkgutil, server, worker, redpacket_client;"
        "from server.store.assets import asset_dir;"
        "[importlib.import_module(m.name) for p in (server, worker, redpacket_client)"
        " for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')"
        " if not m.name.endswith('__main__')];"
        "print(server.__file__); print(asset_dir('lua')); print(asset_dir('web'));"
        "print(asset_dir('clients/js')); print(asset_dir('docs'))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    installed, lua, web, client, docs = out.stdout.split()
    assert installed.startswith(str(venv)), installed  # the installed copy, not this source tree
    assert (Path(lua) / "grab.lua").exists() and (Path(web) / "index.html").exists(), (lua, web)
    # What the hub serves at /client/ and /openapi.json.
    assert (Path(client) / "redpacket.js").exists() and (Path(docs) / "openapi.json").exists(), (client, docs)
    # The console script, run by the new environment's interpreter (pip wrote this run's into its #!).
    helped = subprocess.run(
        [str(venv / "bin" / "python"), str(venv / "bin" / "redpacket"), "--help"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stderr
