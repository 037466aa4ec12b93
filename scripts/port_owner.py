"""`python scripts/port_owner.py HOST PORT NAME`: exit 0 if the stack can listen there, else say who holds it.

`make run` (scripts/run-stack.sh) asks before it starts a process, so that a port already
taken fails in a second with the program holding it named, not after a two-minute wait
for a service that died at once. Linux: the holder is found in /proc (its listening
socket's inode among a process's open files); elsewhere only the port is named.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from pathlib import Path


def taken(host: str, port: int) -> bool:
    """Whether a socket listens on `port` at `host` (or at a wildcard address covering it).

    The bind sets SO_REUSEADDR as uvicorn and redis-server do, so it answers as theirs will: the
    TIME_WAIT connections a stack stopped a moment ago leaves on its port (its own readiness
    checks) are no obstacle, while a listening socket still refuses it with EADDRINUSE."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes


def holder(port: int) -> str | None:
    """"redis-server (pid 123): redis-server 127.0.0.1:6379", or None when it cannot be seen."""
    inodes = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
        except OSError:
            continue  # gone, or not ours to look at
        if fds & inodes:
            name = (proc / "comm").read_text().strip()
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            return f"{name} (pid {proc.name}): {command[:200]}"
    return None


def main(host: str, port: str, name: str) -> int:
    if not taken(host, int(port)):
        return 0
    who = holder(int(port))
    by = f"by {who}" if who else "by a process this user cannot see"
    print(f"mpjobs: port {port} on {host}, wanted for {name}, is already taken {by}.\n"
          f"mpjobs: stop that program, or choose another port: {name_setting(name)}=<port> make run",
          file=sys.stderr)
    return 1


def name_setting(name: str) -> str:
    return {"the API": "PORT", "redis-server": "REDIS_PORT"}.get(name, "PORT")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
