"""The Python client installs alone (issue 45): ``pip install ./clients/python`` gives an app
``redpacket_client`` with websockets and msgpack, and nothing of the server — the hub's package is not
even importable beside it — and it checks a packet's fairness from the protocol's own test vector."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import importlib.util, sys
import redpacket_client
from redpacket_client import HubClient, RedPacketClient, verify
view = {
    "packet_id": 1, "kind": "lucky", "total": 888, "count": 2,
    "seed": "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
    "commitment": "630dcd2966c4336691125448bbb25b4ff412a49c732db2c8abc1b8581bd710dd",
    "grabs": [{"user_id": 7, "seq": 1, "amount": 53}, {"user_id": 8, "seq": 2, "amount": 835}],
}
print(redpacket_client.__file__)
print(verify(view).status, verify({**view, "grabs": [{"user_id": 7, "seq": 1, "amount": 54}]}).status)
print(sorted(m for m in ("server", "worker") if m in sys.modules or importlib.util.find_spec(m)))
"""


def test_the_python_client_installs_alone_and_imports_nothing_of_the_server(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(wheels),
            str(ROOT / "clients/python"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("redpacket_client-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Its two dependencies from this run's environment (nothing downloaded); this run's own packages are
    # an editable install, found through a .pth file that a PYTHONPATH entry never reads.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "PYTHONPATH": ":".join(deps)}
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _PROBE],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    installed, verdicts, server = out.stdout.splitlines()
    assert installed.startswith(str(venv)), installed  # the wheel's copy, not this source tree
    assert verdicts == "verified mismatch"
    assert server == "[]"  # neither the hub's package nor the worker's is there to import
