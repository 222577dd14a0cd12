"""Starting `zlm serve`: the model loaded twice over one set of weights, a bound socket,
uvicorn - in the foreground (the command) or in a thread (tests, scripts).

`load_models` loads the run as `zlm score` does (fp32, so scores are its numbers) and
gives the sampler the same model under the runtime `zlm sample --precision` resolves
(auto: bf16 weights in the step on CPUs with native bf16), so that a seed makes the text
`zlm sample --seed` makes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import sys
import threading
import time

import uvicorn

from zlm.core.precision import resolve_runtime
from zlm.errors import UsageError
from zlm.inference.load import LoadedModel, load_model


def load_models(run, device: str = "auto", precision: str = "auto") -> tuple[LoadedModel, LoadedModel]:
    """(for sampling, for scoring): one model, two runtimes."""
    score_lm = load_model(run, device, "fp32")
    sample_lm = dataclasses.replace(score_lm, runtime=resolve_runtime(device, precision))
    return sample_lm, score_lm


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one); a one-line UsageError when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --host "
                         "or --port") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# The model thread holds the GIL through each C++ step (the extension does not release it),
# so whenever the event loop needs the GIL back - after every write to a socket - it waits
# for the interpreter's switch interval: 5 ms by default, a stall per write with many
# streams. A short interval costs nothing while the loop is idle (nobody asks for the GIL).
SWITCH_INTERVAL_S = 0.0002


def serve(app, sock: socket.socket) -> None:
    """Serve until interrupted (`zlm serve`): the switch interval set for the event loop."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    make_server(app).run(sockets=[sock])


def make_server(app, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, http="h11", ws="none", lifespan="on", log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=3)
    return uvicorn.Server(config)


class ServerThread:
    """The app served on a loopback port from a thread: `with ServerThread(app) as url:`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = make_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="zlm-serve-http", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
