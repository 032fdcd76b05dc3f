"""A free local TCP port for the rendezvous of locally started processes."""

import socket


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
