"""The local S3-API object store (kappa.objectstore): a real SeaweedFS server on loopback, no mocks.

What the lake on it relies on: signed requests with the store's own credential (anything else refused), conditional
writes (``If-None-Match: *`` onto an existing key refused with 412: delta-rs' commit), concurrent delta-rs writers
through :meth:`LocalObjectStore.delta_rs_options` losing nothing, and data surviving a stop, a crash and a restart.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest

from kappa.objectstore import LocalObjectStore, ObjectStoreError, Ports

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def _key() -> str:
    return f"t/{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------- the server
def test_runs_on_loopback_with_private_credentials(object_store: LocalObjectStore) -> None:
    assert object_store.is_running()
    assert object_store.endpoint == f"http://127.0.0.1:{object_store.ports.s3}"
    pids = object_store.pids()
    assert set(pids) == {"server", "volume"}
    listening = {c.laddr for pid in pids.values() for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
    assert {port for _, port in listening} >= {port for _, port in object_store.ports.items()}
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, f"listens beyond loopback: {listening}"
    for f in (object_store.credentials_file, object_store.s3_config_file):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    rss = object_store.rss_bytes()
    assert rss is not None and rss < 1 << 30
    print(f"object store ready in {object_store.last_start_seconds:.1f} s, RSS {rss / 2**20:.0f} MiB")


def test_put_get_list(object_store: LocalObjectStore) -> None:
    key = _key()
    body = os.urandom(100_000)
    assert object_store.request("PUT", "kappa", key, body=body).status_code == 200
    got = object_store.request("GET", "kappa", key)
    assert got.status_code == 200 and got.content == body
    listing = object_store.request("GET", "kappa", query={"list-type": "2", "prefix": key})
    assert listing.status_code == 200 and f"<Key>{key}</Key>" in listing.text
    assert object_store.request("DELETE", "kappa", key).status_code == 204
    assert object_store.request("GET", "kappa", key).status_code == 404


def test_other_credentials_are_refused(object_store: LocalObjectStore) -> None:
    key = _key()
    assert object_store.request("PUT", "kappa", key, body=b"secret data").status_code == 200
    wrong_secret = object_store.request("GET", "kappa", key, secret_access_key="x" * 40)
    assert wrong_secret.status_code == 403 and "SignatureDoesNotMatch" in wrong_secret.text
    unknown_key = object_store.request("GET", "kappa", key, access_key_id="AKIAUNKNOWN0000000000")
    assert unknown_key.status_code == 403
    import requests

    anonymous = requests.get(f"{object_store.endpoint}/kappa/{key}", timeout=10)
    assert anonymous.status_code == 403
    overwrite = object_store.request("PUT", "kappa", key, body=b"x", secret_access_key="x" * 40)
    assert overwrite.status_code == 403
    assert object_store.request("GET", "kappa", key).content == b"secret data"


def test_conditional_put_refuses_an_existing_key(object_store: LocalObjectStore) -> None:
    key = _key()
    first = object_store.request("PUT", "kappa", key, body=b"first", headers={"If-None-Match": "*"})
    assert first.status_code == 200
    second = object_store.request("PUT", "kappa", key, body=b"second", headers={"If-None-Match": "*"})
    assert second.status_code == 412, second.text
    assert object_store.request("GET", "kappa", key).content == b"first"


def test_ensure_bucket(object_store: LocalObjectStore) -> None:
    assert object_store.ensure_bucket("kappa") == "s3://kappa"  # exists: fine
    name = f"b-{uuid.uuid4().hex[:12]}"
    assert object_store.ensure_bucket(name) == f"s3://{name}"
    assert object_store.request("HEAD", name).status_code == 200
    with pytest.raises(ObjectStoreError, match="not a valid bucket name"):
        object_store.ensure_bucket("Bad_Name")


def test_client_settings_name_this_store(object_store: LocalObjectStore) -> None:
    access, secret = object_store.credentials()
    assert object_store.delta_rs_options() == {
        "AWS_ENDPOINT_URL": object_store.endpoint, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": object_store.region, "AWS_ALLOW_HTTP": "true",
    }
    conf = object_store.spark_conf()
    assert conf["spark.hadoop.fs.s3a.endpoint"] == object_store.endpoint
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert (conf["spark.hadoop.fs.s3a.access.key"], conf["spark.hadoop.fs.s3a.secret.key"]) == (access, secret)
    assert conf["spark.hadoop.fs.s3a.aws.credentials.provider"].endswith("SimpleAWSCredentialsProvider")
    reader, reader_secret = object_store.reader_credentials()
    assert json.loads(object_store.credentials_file.read_text()) == {
        "access_key_id": access, "secret_access_key": secret,
        "reader_access_key_id": reader, "reader_secret_access_key": reader_secret}
    assert object_store.reader_env() == {**object_store.delta_rs_options(), "AWS_ACCESS_KEY_ID": reader,
                                         "AWS_SECRET_ACCESS_KEY": reader_secret}
    assert reader != access and reader_secret != secret


def test_the_reader_key_reads_and_lists_only(object_store: LocalObjectStore) -> None:
    """The analysts' key (docs/analysts.md, no server): GET, HEAD and LIST pass; PUT, DELETE and bucket creation are
    refused, and the objects stay as they were."""
    key = _key()
    assert object_store.request("PUT", "kappa", key, body=b"the lake").status_code == 200
    reader, secret = object_store.reader_credentials()

    def as_reader(method: str, bucket: str = "kappa", k: str = "", **kw: object) -> int:
        return object_store.request(method, bucket, k, access_key_id=reader, secret_access_key=secret,
                                    **kw).status_code  # type: ignore[arg-type]

    got = object_store.request("GET", "kappa", key, access_key_id=reader, secret_access_key=secret)
    assert got.status_code == 200 and got.content == b"the lake"
    assert as_reader("HEAD", k=key) == 200
    listing = object_store.request("GET", "kappa", query={"list-type": "2", "prefix": key}, access_key_id=reader,
                                   secret_access_key=secret)
    assert listing.status_code == 200 and f"<Key>{key}</Key>" in listing.text
    assert as_reader("PUT", k=key, body=b"changed") == 403
    assert as_reader("PUT", k=_key(), body=b"new") == 403
    assert as_reader("DELETE", k=key) == 403
    assert as_reader("PUT", f"b-{uuid.uuid4().hex[:12]}") == 403
    assert object_store.request("GET", "kappa", key).content == b"the lake"


# --------------------------------------------------------------------------------------------- delta-rs
_WRITER = """
import json, sys
from deltalake import write_deltalake
from kappa.runtime.deltars import I64, STR, arrow_rows
uri, writer, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = json.loads(sys.stdin.read())  # the credential stays off the command line
for seq in range(n):
    write_deltalake(uri, arrow_rows((("writer", STR), ("seq", I64)), [{"writer": writer, "seq": seq}]),
                    mode="append", storage_options=options)
"""


def test_delta_rs_concurrent_appends_lose_nothing(object_store: LocalObjectStore) -> None:
    from deltalake import DeltaTable, write_deltalake

    from kappa.runtime.deltars import I64, STR, arrow_rows, read_rows

    options = object_store.delta_rs_options()
    assert "AWS_S3_LOCKING_PROVIDER" not in options
    uri = f"s3://kappa/tables/{uuid.uuid4().hex}"
    columns = (("writer", STR), ("seq", I64))
    write_deltalake(uri, arrow_rows(columns, [{"writer": "creator", "seq": 0}]), storage_options=options)
    writers, appends = 4, 5
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, uri, f"w{i}", str(appends)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(writers)]
    for proc in procs:
        _, err = proc.communicate(json.dumps(options), timeout=120)
        assert proc.returncode == 0, err[-2000:]
    table = DeltaTable(uri, storage_options=options)
    rows = Counter((r["writer"], r["seq"]) for r in read_rows(table))
    expected = {("creator", 0)} | {(f"w{i}", s) for i in range(writers) for s in range(appends)}
    assert set(rows) == expected and set(rows.values()) == {1}, "every row exactly once"
    assert table.version() == writers * appends, "one version per commit"
    assert len(table.history()) == writers * appends + 1
    # the log on the store: one JSON commit per version, nothing overwritten
    listing = object_store.request("GET", "kappa", query={"list-type": "2", "prefix": uri[len("s3://kappa/"):]
                                                          + "/_delta_log/", "max-keys": "1000"})
    assert listing.text.count(".json</Key>") == writers * appends + 1


# ----------------------------------------------------------------------------------- stop, crash, restart
def _an_address_of_this_machine() -> str:
    """An IPv4 address of this machine other than loopback (what a pod on the machine routes to)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.fail(f"no IPv4 address beside loopback: {psutil.net_if_addrs()}")


def test_s3_bind_opens_the_gateway_alone_to_other_addresses(object_store: LocalObjectStore, tmp_path: Path) -> None:
    """``s3_bind``: the S3 gateway listens on every address - a signed request through this machine's own address
    (what a pod reaches) puts and reads, an unsigned or wrongly signed one is refused - while the master, filer and
    volume server, which check no credential, stay on loopback; the default store is not reachable that way."""
    import requests

    address = _an_address_of_this_machine()
    with pytest.raises(requests.ConnectionError):  # the session's store: loopback only
        object_store.request("GET", "kappa", address=address, timeout=5)
    with pytest.raises(ObjectStoreError, match="not an IPv4 address"):
        LocalObjectStore(tmp_path / "bad", s3_bind="every-address")
    store = LocalObjectStore(tmp_path / "bound", ports=Ports.free(), weed=object_store.weed, s3_bind="0.0.0.0")
    try:
        store.start()
        assert store.running_s3_bind() == "0.0.0.0" and store.endpoint == f"http://127.0.0.1:{store.ports.s3}"
        listening = {c.laddr for pid in store.pids().values()
                     for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        s3_ports = {store.ports.s3, store.ports.s3_grpc}
        assert {ip for ip, port in listening if port not in s3_ports} == {"127.0.0.1"}, listening
        assert {ip for ip, port in listening if port == store.ports.s3} & {"0.0.0.0", "::"}, listening
        store.ensure_bucket("kappa")
        key, body = _key(), os.urandom(10_000)
        assert store.request("PUT", "kappa", key, body=body, address=address).status_code == 200
        assert store.request("GET", "kappa", key, address=address).content == body
        assert store.request("GET", "kappa", key).content == body  # and on loopback, as local clients use it
        assert requests.get(f"http://{address}:{store.ports.s3}/kappa/{key}", timeout=5).status_code == 403
        assert store.request("GET", "kappa", key, address=address, access_key_id="AKIANOTTHEKEY",
                             secret_access_key="x" * 40).status_code == 403
    finally:
        store.stop()


def test_ports_in_use_are_refused(object_store: LocalObjectStore, tmp_path: Path) -> None:
    clash = LocalObjectStore(tmp_path / "clash", ports=object_store.ports, weed=object_store.weed)
    with pytest.raises(ObjectStoreError, match="already in use"):
        clash.start()
    assert not clash.is_running() and clash.pids() == {}


def test_data_survives_stop_start_and_a_crash(object_store: LocalObjectStore, tmp_path: Path) -> None:
    """The session's store stopped and started, then killed and restarted (a restart while nothing runs): what
    it acknowledged stays, and so does what a conditional write relies on. It runs on afterwards (same ports, data)."""
    store = object_store
    idle = LocalObjectStore(tmp_path / "idle", ports=Ports.free(), weed=store.weed)
    assert idle.stop() is False and idle.kill() is False and idle.pids() == {}
    keys: dict[str, str] = {}
    try:
        for phase in ("before-stop", "before-crash"):
            keys[phase] = _key()
            assert store.request("PUT", "kappa", keys[phase], body=phase.encode(),
                                 headers={"If-None-Match": "*"}).status_code == 200
            if phase == "before-stop":
                assert store.stop() is True and not store.is_running() and store.pids() == {}
                store.start()
            else:
                assert store.kill() is True and not store.is_running() and store.pids() == {}
                store.restart()  # while nothing runs: a plain start
            assert store.is_running()
            print(f"{phase}: ready again in {store.last_start_seconds:.1f} s")
            for done, key in keys.items():
                got = store.request("GET", "kappa", key)
                assert got.status_code == 200 and got.content == done.encode(), (phase, done)
                # a commit that lost its race still loses after the restart
                assert store.request("PUT", "kappa", key, body=b"again",
                                     headers={"If-None-Match": "*"}).status_code == 412
    finally:
        store.start()  # the session's store runs on for the tests after this one


# ----------------------------------------------------------------------------------------- command line
def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KAPPA_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "kappa.objectstore", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_secret_env_prints_the_platform_credential_for_a_kubernetes_secret(tmp_path: Path) -> None:
    """``secret-env``: the lines ``kubectl create secret generic --from-env-file`` reads, the platform's credential
    (not the read-only one), the same at every call."""
    first, again = _cli(tmp_path, "secret-env"), _cli(tmp_path, "secret-env")
    assert first.returncode == 0 and first.stdout == again.stdout, first.stderr
    printed = dict(line.split("=", 1) for line in first.stdout.splitlines())
    store = LocalObjectStore(tmp_path / "objectstore")
    assert printed == {"AWS_ACCESS_KEY_ID": store.credentials()[0], "AWS_SECRET_ACCESS_KEY": store.credentials()[1]}
    assert printed["AWS_ACCESS_KEY_ID"] != store.reader_credentials()[0]


def test_cli_one_line_answers(tmp_path: Path) -> None:
    status = _cli(tmp_path, "status")
    assert status.returncode == 1 and "not running" in status.stdout
    down = _cli(tmp_path, "down")
    assert down.returncode == 0 and "was not running" in down.stdout
    for bad in ((), ("sideways",), ("up", "--s3-bind", "everywhere")):
        wrong = _cli(tmp_path, *bad)
        assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
        assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
        assert wrong.stderr.startswith("objectstore: error:")
    assert "is not an IPv4 address" in wrong.stderr
