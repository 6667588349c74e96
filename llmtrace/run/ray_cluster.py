"""Joining Ray for `llmtrace eval --ray`: "local" starts a cluster of this machine on loopback only; an address joins
that cluster, and a refusal by Ray's token authentication is said in one line with how to give the token.

Ray (2.60) turns a node address of 127.0.0.1 into the machine's network address, and its servers then listen there
(services.resolve_ip_for_localhost), unless its switch for a machine that runs no cluster is off:
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read into ray_constants.ENABLE_RAY_CLUSTER when ray is imported. With it off and
`_node_ip_address="127.0.0.1"`, the GCS, the raylet and the workers all listen on 127.0.0.1.

A cluster started with `ray start --head` has token authentication on by default (Ray 2.60); a driver without the
token gets only "Failed to connect to Ray cluster at ..." from ray.init, with the cause (an AuthenticationError,
"Authentication token is missing or incorrect") chained below it."""

from __future__ import annotations

import contextlib
import os
import sys

from llmtrace.errors import LlmtraceError, UsageError

LOOPBACK = "127.0.0.1"
_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def require_ray():
    """The ray module, or a one-line usage error where it is not installed."""
    try:
        import ray
    except ImportError:
        from llmtrace.extras import install_hint

        raise UsageError(f"Ray is not installed: {install_hint('ray')} (or pip install ray)") from None
    return ray


@contextlib.contextmanager
def _on_loopback():
    """Ray's node address stays 127.0.0.1 while this holds (see the module's docstring): the switch in the
    environment (for a ray imported now, and the processes Ray starts) and in ray_constants (for one imported
    before). Both as they were afterwards."""
    saved = os.environ.get(_SWITCH)
    os.environ[_SWITCH] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    was = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    try:
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = False
        yield
    finally:
        if saved is None:
            os.environ.pop(_SWITCH, None)
        else:
            os.environ[_SWITCH] = saved
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = was


def refused_by_token(e: BaseException) -> bool:
    """Whether Ray's connection error E (or an error chained below it) is its token authentication's refusal."""
    seen = 0
    while e is not None and seen < 16:
        if type(e).__name__ == "AuthenticationError" or "Authentication token is missing or incorrect" in str(e) \
                or "InvalidAuthToken" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def token_refusal(address: str) -> str:
    """The one line for a cluster that refused this driver's token."""
    return (f"Ray's cluster at {address} refused the connection: its authentication token is missing or wrong (Ray "
            f"turns token authentication on by default); give it with RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<token>, "
            f"which `ray get-auth-token` prints on the head node")


def start_ray(address: str):
    """Ray, joined to the cluster at `address`; "local": a new cluster of this machine, on 127.0.0.1 only."""
    if address == "local":
        with _on_loopback():
            ray = require_ray()
            if not ray.is_initialized():
                ray.init(address="local", _node_ip_address=LOOPBACK, ignore_reinit_error=True, log_to_driver=False)
        return ray
    ray = require_ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        except Exception as e:  # ConnectionError from ray.init; RuntimeError or its own from Ray Client (ray://)
            if refused_by_token(e):
                raise LlmtraceError(token_refusal(address)) from None
            raise
    return ray
