"""The test kinds stay apart: a test not marked ``server`` (or ``distributed``)
cannot start a process or a server, so the quick subset
(``-m "not server and not distributed"``) never starts one (``tests/conftest.py``)."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys

import pytest

from tests.conftest import refusing_servers


def test_starting_a_process_fails_the_test_naming_the_mark():
    with refusing_servers("the test") as tried:
        with pytest.raises(pytest.fail.Exception, match=r"pytestmark = pytest\.mark\.server"):
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        with pytest.raises(pytest.fail.Exception):
            multiprocessing.get_context("spawn").Process(target=print).start()
    assert [t.split(" (")[0] for t in tried] == ["starts a process"] * 2


def test_listening_on_a_socket_fails_the_test():
    with socket.socket() as sock, refusing_servers("the test") as tried:
        sock.bind(("127.0.0.1", 0))  # a client may bind; a server listens
        with pytest.raises(pytest.fail.Exception, match="listens on"):
            sock.listen()
    assert len(tried) == 1


def test_an_unmarked_test_is_guarded():
    assert subprocess.Popen.__init__.__name__ == "guarded_popen_init"
    assert socket.socket.listen.__name__ == "guarded_listen"


@pytest.mark.server
def test_a_marked_test_is_not():
    assert subprocess.Popen.__init__.__module__ == "subprocess"
    assert socket.socket.listen is socket._socket.socket.listen
