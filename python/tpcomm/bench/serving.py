"""A serving program's own TCP traffic, beside tpcomm: an echo server on one
thread and a client thread that keeps opening connections (to this
process's server and to its peers'), as an inference server's HTTP, ZMQ and
metrics threads do while groups come and go. The tests of
coordinator/faults/gloo_sockets.hpp and `python -m tpcomm.bench soak` use it to
check that no group's break touches a connection of the program's."""

import os
import selectors
import socket
import threading
import time


class EchoTraffic:
    """An echo server on `port` (0: any free one) and, after
    start_clients(), a thread that opens one connection every `every_s`
    seconds to the servers at `ports` (round robin; this process's own when
    empty), up to `limit`, and keeps every one open. Both ends of each
    connection to this process's server are the program's."""

    def __init__(self, port=0, host="127.0.0.1"):
        self.host = host
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._accepted = []  # by _lock
        self._clients = []   # by _lock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_clients = threading.Event()
        self._client_thread = None
        self.server_errors = []
        self._server_thread = threading.Thread(target=self._serve, name="echo-server",
                                               daemon=True)
        self._server_thread.start()

    # ------------------------------------------------------------- server
    def _serve(self):
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                try:
                    if sock is self._listener:
                        conn, _ = sock.accept()
                        conn.setblocking(True)
                        conn.settimeout(5)
                        with self._lock:
                            self._accepted.append(conn)
                        self._selector.register(conn, selectors.EVENT_READ)
                        continue
                    data = sock.recv(4096)
                    if data:
                        sock.sendall(data)
                    else:
                        self._selector.unregister(sock)
                except BlockingIOError:
                    pass
                except OSError as e:
                    self.server_errors.append(repr(e))
                    try:
                        self._selector.unregister(sock)
                    except (KeyError, ValueError):
                        pass

    # ------------------------------------------------------------- clients
    def start_clients(self, ports=(), every_s=0.0002, limit=400):
        """Opens connections in a thread of its own until stop_clients() or
        `limit` connections."""
        targets = list(ports) or [self.port]
        self._stop_clients.clear()

        def run():
            i = 0
            while not self._stop_clients.is_set() and self.opened < limit:
                target = targets[i % len(targets)]
                i += 1
                try:
                    s = socket.create_connection((self.host, target), timeout=5)
                except ConnectionRefusedError:
                    # A peer's server that is not up yet: the next target.
                    time.sleep(every_s or 0.001)
                    continue
                with self._lock:
                    self._clients.append(s)
                if every_s:
                    time.sleep(every_s)

        self._client_thread = threading.Thread(target=run, name="echo-clients", daemon=True)
        self._client_thread.start()

    def stop_clients(self):
        self._stop_clients.set()
        if self._client_thread is not None:
            self._client_thread.join(timeout=30)

    @property
    def opened(self):
        """Connections opened by the client thread so far."""
        with self._lock:
            return len(self._clients)

    def fds(self):
        """Every descriptor of the program's connections (client ends and
        accepted ends) and of its listener."""
        with self._lock:
            socks = [*self._clients, *self._accepted, self._listener]
        return {s.fileno() for s in socks if s.fileno() >= 0}

    def broken(self, timeout_s=5.0):
        """The client connections that no longer answer an echo: a list of
        (index, what went wrong); empty when every one answers."""
        with self._lock:
            clients = list(self._clients)
        failures = []
        for i, s in enumerate(clients):
            message = b"%d;" % i
            try:
                s.settimeout(timeout_s)
                s.sendall(message)
                got = b""
                while len(got) < len(message):
                    chunk = s.recv(len(message) - len(got))
                    if not chunk:
                        raise ConnectionError("closed by the other end")
                    got += chunk
                if got != message:
                    raise ConnectionError(f"echoed {got!r} for {message!r}")
            except OSError as e:
                failures.append((i, repr(e)))
        return failures

    def close(self):
        self.stop_clients()
        self._stop.set()
        self._server_thread.join(timeout=30)
        with self._lock:
            socks = [*self._clients, *self._accepted]
            self._clients, self._accepted = [], []
        for s in socks:
            s.close()
        self._selector.close()
        self._listener.close()


def inode_of(fd):
    """The inode of descriptor `fd`'s socket, or None once it is closed."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def shut_down(fd, inode):
    """Whether the connection that descriptor `fd` held (its socket's
    `inode`) was shut down: reading it gives end of file at once (nothing is
    consumed), or its owner closed it since."""
    if inode_of(fd) != inode:
        return True
    try:
        s = socket.socket(fileno=socket.dup(fd))
    except OSError:
        return True
    try:
        s.setblocking(False)
        try:
            return s.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
    finally:
        s.close()
