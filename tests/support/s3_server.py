"""A real S3 API server for the remote-archive tests and ``bench/remote.py``: moto's, on
127.0.0.1 (a free port), with IAM authentication switched on and every request counted at the
server (method, key, status, bytes sent).

``S3Server.start()`` needs the ``remote`` and ``test`` extras (``moto[s3]``, flask, flask-cors,
s3fs): :func:`skip_unless_installed` skips a test module that needs them with the reason, or
fails it when ``FKV_REQUIRE_REMOTE=1`` (CI and ``make test`` set it: there the extras are
installed, and a skip would hide that the remote tests did not run).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

REGION = "us-east-1"
S3_PACKAGES = ("fsspec", "s3fs", "moto", "flask", "flask_cors", "boto3")


def skip_unless_installed(packages=S3_PACKAGES) -> None:
    """Skip the calling test module unless ``packages`` are importable; with
    ``FKV_REQUIRE_REMOTE=1`` fail instead (a collection error fails the run)."""
    import pytest

    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if not missing:
        return
    reason = (f"remote-archive tests need {', '.join(missing)} (the 'remote' and 'test' extras: "
              "pip install -e '.[remote,test]')")
    if os.environ.get("FKV_REQUIRE_REMOTE") == "1":
        pytest.fail(f"{reason}; FKV_REQUIRE_REMOTE=1 forbids skipping them", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@dataclass(frozen=True)
class Request:
    """One request as the server answered it."""

    method: str
    path: str  # /bucket/key
    query: str
    status: int
    bytes_out: int  # response body bytes
    range: str  # the Range header ("" if none)


class _Counter:
    """WSGI middleware: records every request after its response body is sent."""

    def __init__(self, app):
        self.app = app
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Until every request whose response a client may have seen is in the log."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    def __call__(self, environ, start_response):
        # a generator: this runs when the server starts sending, before any response byte
        with self._lock:
            self._in_flight += 1
        status = []

        def start(st, headers, exc_info=None):
            status.append(int(st.split()[0]))
            return start_response(st, headers, exc_info)

        body = self.app(environ, start)
        sent = 0
        try:
            for piece in body:
                sent += len(piece)
                yield piece
        finally:
            if hasattr(body, "close"):
                body.close()
            with self._idle:
                self.log.append(Request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                        environ.get("QUERY_STRING", ""),
                                        status[0] if status else 0, sent,
                                        environ.get("HTTP_RANGE", "")))
                self._in_flight -= 1
                self._idle.notify_all()


@dataclass
class Counts:
    """Requests to the bucket seen while a :meth:`S3Server.counting` block ran."""

    requests: list[Request] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def gets(self) -> int:
        return sum(r.method == "GET" for r in self.requests)

    @property
    def bytes_out(self) -> int:
        return sum(r.bytes_out for r in self.requests)


class S3Server:
    """moto's S3 (and IAM) on 127.0.0.1; ``auth=True`` makes it check credentials: only
    :attr:`storage_options` (a user allowed ``s3:*``) may read and write. moto's state is
    per process: :meth:`start` empties it, so run one server per process at a time."""

    def __init__(self, auth: bool = True, bucket: str = "fkv"):
        self.auth = auth
        self.bucket = bucket
        self._server = None
        self._counter: _Counter | None = None

    def start(self) -> S3Server:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        # count at the server: every request goes through this WSGI middleware
        self._counter = _Counter(self._server._server.app)
        self._server._server.app = self._counter
        key, secret = self._setup()
        self.storage_options = self.options(key, secret)
        self.bad_options = self.options(key, "not-the-secret")
        return self

    def options(self, key: str, secret: str) -> dict:
        """fsspec storage options for this server with the given credentials."""
        return {"key": key, "secret": secret,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    def _moto_api(self, action: str, data: bytes) -> None:
        urllib.request.urlopen(urllib.request.Request(
            f"{self.endpoint}/moto-api/{action}", data=data, method="POST",
            headers={"Content-Type": "text/plain"})).read()

    def _setup(self) -> tuple[str, str]:
        import boto3

        # moto keeps its accounts, buckets and authentication switch per process, not per
        # server: a server started after another one in this process (a second test module)
        # would find auth already on and the user and bucket already there
        self._moto_api("reset-auth", b"inf")
        self._moto_api("reset", b"")
        kw = {"endpoint_url": self.endpoint, "region_name": REGION,
              "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="fkv")
        iam.put_user_policy(UserName="fkv", PolicyName="s3", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="fkv")["AccessKey"]
        boto3.client("s3", **kw).create_bucket(Bucket=self.bucket)
        if self.auth:  # from now on every request must be signed by a known key
            self._moto_api("reset-auth", b"0")
        return key["AccessKeyId"], key["SecretAccessKey"]

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    @contextmanager
    def counting(self):
        """Yields a :class:`Counts` filled with the requests made inside the block."""
        counts = Counts()
        self._counter.wait_idle()  # requests answered before the block are not counted in it
        start = len(self._counter.log)
        try:
            yield counts
        finally:
            self._counter.wait_idle()
            counts.requests[:] = self._counter.log[start:]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
