"""The server's listening ports: each bound by this process alone, checked before the model loads.

gRPC's C core sets SO_REUSEPORT on Linux by default, so a second server on a
port another one listens on starts without an error and the kernel splits the
connections between the two (each with its own log and journal). The server
turns that off (``GRPC_OPTIONS``) and checks its ports before the model loads
(``check_port_free``), so a clash costs a second and names the port.
"""

from __future__ import annotations

import errno
import socket

# grpc.aio.server options that make the gRPC port this process's own
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)


class PortUnavailableError(OSError):
    """A port the server is configured to listen on cannot be bound: taken by another process
    (errno EADDRINUSE), privileged (EACCES), an address this machine lacks (EADDRNOTAVAIL), or a
    host name that does not resolve (``socket.gaierror``).

    ``setting`` names the flag (``--port``, ``--metrics-port``)."""

    def __init__(self, setting: str, host: str, port: int, error: OSError) -> None:
        self.setting, self.host, self.port = setting, host, port
        cause = error.strerror or str(error)
        message = f"{setting} {port}: {host}:{port} cannot be bound ({cause})"
        if error.errno == errno.EADDRINUSE:
            message += (
                f": another server listens there (`ss -ltnp 'sport = :{port}'` names it); "
                f"stop it or choose another {setting}"
            )
        else:
            message += f"; choose another {setting}" + (" or --host" if setting == "--port" else " or --metrics-host")
        super().__init__(error.errno or errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)


def check_port_free(setting: str, host: str, port: int) -> None:
    """Raises PortUnavailableError when ``host:port`` cannot be bound for listening now.

    Port 0 (any free port) is always free. The check binds a socket as a server
    does (SO_REUSEADDR, no SO_REUSEPORT) and closes it at once; the real bind
    later can still lose a race, and then says the same. A host that does not
    resolve is refused here too (its cause, e.g. "Name or service not known").
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailableError(setting, host, port, exc) from None
    if port == 0:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as exc:
            raise PortUnavailableError(setting, host, port, exc) from None
