"""`--ray` (llmtrace/run/ray_cluster.py, issue 52 item 9): "local" is a cluster of this machine on loopback only, and
a cluster that refuses this driver's token is said in one line with how to give it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtrace.run.ray_cluster import refused_by_token, token_refusal

ROOT = Path(__file__).resolve().parents[1]

# what ray.init raised against a `ray start --head` cluster of Ray 2.60 (token authentication on) from a driver
# without the token, on this project's machine: a ConnectionError, and below it the RuntimeError whose text ends
# with the AuthenticationError (shortened where it names files)
RAY_260_REFUSAL = (
    "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
    '  File "python/ray/includes/common.pxi", line 119, in ray._raylet.check_status\n'
    "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect. "
    "Note: RAY_AUTH_MODE is currently 'disabled' (not 'token'). Ensure that the token for the cluster is available in "
    "a local file (e.g., ~/.ray/auth_token or via RAY_AUTH_TOKEN_PATH) or as the `RAY_AUTH_TOKEN` environment "
    "variable.")
RAY_260_NOBODY_THERE = ("Failed to connect to GCS. Last connection error: RPC error: TimedOut: Timed out while waiting "
                        "for GCS to become available.")


def _raised(cause: str) -> ConnectionError:
    try:
        try:
            raise RuntimeError(cause)
        except RuntimeError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from e
    except ConnectionError as e:
        return e


def test_the_token_refusal_is_told_apart_from_other_failures():
    assert refused_by_token(_raised(RAY_260_REFUSAL))
    assert not refused_by_token(_raised(RAY_260_NOBODY_THERE))
    line = token_refusal("10.0.0.5:6379")
    assert "\n" not in line and "10.0.0.5:6379" in line and "authentication token" in line
    assert "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=" in line and "ray get-auth-token" in line


def test_ray_own_authentication_error_is_recognised():
    exceptions = pytest.importorskip("ray.exceptions")
    try:
        try:
            raise exceptions.AuthenticationError("RPC error: InvalidAuthToken")
        except exceptions.AuthenticationError as e:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from e
    except ConnectionError as e:
        assert refused_by_token(e)


HEAD = """
import json, sys
from llmtrace.run.ray_cluster import start_ray
ray = start_ray("local")
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes()]}), flush=True)
sys.stdin.readline()
ray.shutdown()
"""


@pytest.mark.slow  # a Ray cluster starts (about 20 s), and a driver is refused by it
def test_local_is_on_loopback_and_a_wrong_token_is_one_line(tmp_path, tiny_lm):
    pytest.importorskip("ray")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path / "head-home"), RAY_AUTH_MODE="token")
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        started = json.loads(head.stdout.readline())
        host, port = started["gcs"].rsplit(":", 1)
        assert host == "127.0.0.1" and started["nodes"] == ["127.0.0.1"]  # not the machine's network address
        text = tmp_path / "t.txt"
        text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
        driver = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(tmp_path / "driver-home"), RAY_AUTH_MODE="token",
                      RAY_AUTH_TOKEN="not-the-token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        done = subprocess.run([sys.executable, "-m", "llmtrace", "eval", str(text), "-m", str(tiny_lm.path), "--ctx",
                               "32", "--chunks", "2", "--ray", started["gcs"]], capture_output=True, text=True,
                              env=driver, timeout=300)
        assert done.returncode == 1, done.stderr
        ours = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert ours == [f"error: {token_refusal(started['gcs'])}"], done.stderr
        assert "Traceback" not in done.stderr
    finally:
        head.stdin.close()
        head.wait(120)
