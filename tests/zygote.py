"""Warm starts for the tests' XLA children: a server that has imported torch and torch_xla forks each child from
itself, so a child skips the ~10 s of CPU those imports cost (torch ~4 s, torch_xla ~6 s: its import pulls in
torch._dynamo and inductor), most of a short scenario's time on CI's 2 cores. tests/child.py's command() uses it
for XLA children: the tests', and the bench's in a smoke run (bench.py's python()).

    python tests/zygote.py serve SOCKET           # import torch and torch_xla, then fork a child per request
    python tests/zygote.py run SOCKET SCRIPT ARGS  # a child: SCRIPT ARGS, run by a fork of the server

`run` is a light stand-in process (no torch) that a test starts and reads like the child itself: it hands its
stdin, stdout and stderr, its working directory and its environment to the server, forwards the signals it gets to
the fork, and ends as the fork ended (its exit code, or the same signal). A fork is a fresh interpreter that had
imported torch and torch_xla first: the server is started with the child's environment but for LATE (names read
after those imports only), which each fork takes from its request; it replays what the imports printed to stderr,
reseeds `random` and numpy, and ends as an interpreter does (non-daemon threads joined, atexit run, streams
flushed). A stand-in killed (a test's timeout) takes its fork with it.
"""

import json
import os
import select
import signal
import socket
import sys

LATE = ("SEAMLESS_TPU_", "PYTEST_", "TMPDIR")  # names (prefixes) no import of torch or torch_xla reads
PRELOAD = ("torch", "torch_xla", "torch_xla.runtime", "torch_xla.core.xla_model", "torch_xla.distributed.spmd",
           "torch_xla.debug.metrics")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def late(name):
    return name.startswith(LATE)


def serve(path):
    import importlib
    import tempfile

    with tempfile.TemporaryFile() as said:  # what the imports print to stderr, for every fork to print again
        saved = os.dup(2)
        os.dup2(said.fileno(), 2)
        for name in PRELOAD:
            importlib.import_module(name)
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        said.seek(0)
        printed = said.read()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("READY", flush=True)
    parent, live = os.getppid(), {}  # {fork's pid: its stand-in's connection}
    while os.getppid() == parent:  # the test process is gone: so are we, and our forks
        ready, _, _ = select.select([server, *live.values()], [], [], 0.2)
        for conn in ready:
            if conn is server:
                pid, conn = start(server, live, printed)
                live[pid] = conn
            else:  # a stand-in closed its end before its fork ended: it was killed
                os.kill(next(pid for pid, c in live.items() if c is conn), signal.SIGKILL)
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = live.pop(pid)
            with conn:
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
    for pid in live:
        os.kill(pid, signal.SIGKILL)


def start(server, live, printed):
    conn, _ = server.accept()
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    with conn.makefile("rb") as f:
        request = json.loads(f.readline())
    pid = os.fork()
    if pid == 0:
        server.close()
        for c in (*live.values(), conn):
            c.close()
        run_fork(request, fds, printed)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid, conn


def run_fork(request, fds, printed):
    import atexit
    import random
    import runpy
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.write(2, printed)
    env = request["env"]
    for name in [n for n in os.environ if late(n) and n not in env]:
        del os.environ[name]
    os.environ.update({k: v for k, v in env.items() if late(k)})
    os.chdir(request["cwd"])
    script, *_ = sys.argv = request["args"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number itself, anything else printed, 1
        code = e.code or 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as e:  # printed as the interpreter would: sys.excepthook, from the script's own frames
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        tb = tb or e.__traceback__
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the exception's own traceback is the one printed
        code = 1
    threading._shutdown()  # as an interpreter ends: join non-daemon threads, then atexit, then flush
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(int(code))


def run(path, args):
    fork, early = [], []  # a signal that comes before the fork's pid is passed on once it is known

    def forward(number, _):
        os.kill(fork[0], number) if fork else early.append(number)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(conn, [b"x"], [0, 1, 2])
    conn.sendall(json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n")
    replies = conn.makefile("rb")
    fork.append(json.loads(replies.readline())["pid"])
    for number in early:
        os.kill(fork[0], number)
    code = os.waitstatus_to_exitcode(json.loads(replies.readline())["status"])
    if code < 0:  # end by the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    role, path, *rest = sys.argv[1:]
    serve(path) if role == "serve" else run(path, rest)
