"""The identity key's temp file: a fresh name per write, so neither a run killed mid-write
(every run is PID 1 in a container) nor a concurrent creator in the same process collides."""

import os
import threading

from libp2p.crypto.pb import crypto_pb2

from fusionllm.node.p2p import identity
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of


def _stale_temp_files(path, pid: int) -> None:
    """What a run killed between creating and unlinking its temp file left behind, named the
    way a pid-based scheme names it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = path.with_name(f".{path.name}.{pid}.tmp")
    stale.write_bytes(b"half a key")
    stale.chmod(0o600)


def test_key_is_created_past_a_temp_file_left_by_a_killed_pid_1(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "node.key"
    monkeypatch.setattr(os, "getpid", lambda: 1)
    _stale_temp_files(path, 1)
    first = peer_id_of(load_or_create_identity(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert peer_id_of(load_or_create_identity(path)) == first
    # Only the key and the stale file: our own temp file is gone.
    assert sorted(p.name for p in path.parent.iterdir()) == [".node.key.1.tmp", "node.key"]


def test_seed_only_key_is_rewritten_past_a_stale_temp_file(tmp_path):
    path = tmp_path / "node.key"
    pair = identity.new_ed25519_key_pair()
    seed_only = crypto_pb2.PrivateKey(
        key_type=crypto_pb2.KeyType.Ed25519, data=pair.private_key.to_bytes()
    )
    path.write_bytes(seed_only.SerializeToString())
    path.chmod(0o600)
    _stale_temp_files(path, os.getpid())
    assert peer_id_of(load_or_create_identity(path)) == peer_id_of(pair)
    assert path.read_bytes() == identity.standard_encoding(pair)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_concurrent_creators_in_one_process_all_get_the_first_key(tmp_path):
    path = tmp_path / "node.key"
    start = threading.Barrier(8)
    ids: list[str] = []
    errors: list[BaseException] = []

    def create() -> None:
        start.wait()
        try:
            ids.append(peer_id_of(load_or_create_identity(path)))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(ids) == 8
    assert set(ids) == {peer_id_of(load_or_create_identity(path))}
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]
