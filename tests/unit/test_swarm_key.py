"""A private swarm's key: the file (format, size, mode, kind), the derived keys, and the tags
that keep records and proposals of nodes without it out of a keyed directory."""

import os
import socket
import stat

import msgpack
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.common.swarm_key import (
    HEADER,
    SwarmKey,
    SwarmKeyError,
    load_swarm_key,
    write_swarm_key,
)
from fusionllm.dht.cipher import RecordCipher, UnsealedRecordError
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.envelope import open_envelope, seal
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import RecordError
from fusionllm.node.control.node_config import NodeConfig
from fusionllm.node.control.swarm_settings import SwarmSettings
from tests.support.identities import Identity
from tests.unit.test_envelope import node_info, plan_proposal

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def _key_file(tmp_path, text: bytes, mode: int = 0o600, name: str = "swarm.key"):
    path = tmp_path / name
    path.write_bytes(text)
    path.chmod(mode)
    return path


# ----------------------------------------------------------------------------- the file


def test_keygen_writes_a_private_file_that_loads_to_the_same_key(tmp_path):
    path = tmp_path / "dir" / "swarm.key"
    written = write_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = path.read_bytes()
    assert data.startswith(HEADER)
    assert len(bytes.fromhex(data[len(HEADER) :].decode())) == 32
    assert load_swarm_key(path).digest == written.digest
    assert [p.name for p in path.parent.iterdir()] == ["swarm.key"]  # no temp file left
    with pytest.raises(SwarmKeyError, match=r"exists; not replacing it"):
        write_swarm_key(path)
    assert write_swarm_key(tmp_path / "b.key").digest != written.digest


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (HEADER + b"00" * 31, r"31 bytes, too short \(at least 32\)"),
        (HEADER, r"0 bytes, too short"),
        (HEADER + b"zz" * 32, r"the key is not hex digits"),
        (b"/key/swarm/psk/1.0.0/\n/base64/\n" + b"A" * 44, r"expected go-libp2p's format"),
        (SECRET.hex().encode(), r"expected go-libp2p's format"),
        (HEADER + b"00" * 1025, r"over 1024 bytes"),
    ],
)
def test_a_malformed_or_short_file_is_refused(tmp_path, text, match):
    with pytest.raises(SwarmKeyError, match=match):
        load_swarm_key(_key_file(tmp_path, text))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = _key_file(tmp_path, HEADER + SECRET.hex().encode(), mode)
    with pytest.raises(SwarmKeyError, match=rf"group or others may access it \(mode {mode:03o}\)"):
        load_swarm_key(path)
    path.chmod(0o400)
    assert load_swarm_key(path).digest == SwarmKey(SECRET).digest


def test_only_a_regular_file_is_a_key(tmp_path):
    target = _key_file(tmp_path, HEADER + SECRET.hex().encode())
    link = tmp_path / "link.key"
    link.symlink_to(target)
    with pytest.raises(SwarmKeyError, match=r"link\.key: Too many levels of symbolic links"):
        load_swarm_key(link)
    directory = tmp_path / "dir.key"
    directory.mkdir(mode=0o700)
    with pytest.raises(SwarmKeyError, match=r"dir\.key: not a regular file"):
        load_swarm_key(directory)
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SwarmKeyError, match=r"fifo\.key: not a regular file"):
        load_swarm_key(fifo)  # never blocks waiting for a writer
    with pytest.raises(SwarmKeyError, match=r"missing\.key: No such file"):
        load_swarm_key(tmp_path / "missing.key")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "s.key"))
        with pytest.raises(SwarmKeyError, match=r"s\.key: "):
            load_swarm_key(tmp_path / "s.key")


def test_a_swarm_key_error_is_a_config_error_and_the_repr_hides_the_secret():
    key = SwarmKey(SECRET)
    assert issubclass(SwarmKeyError, ConfigError)
    assert SECRET.hex() not in repr(key) + key.pnet_psk + key.digest
    assert repr(key) == f"SwarmKey(digest={key.digest})"
    assert len(key.pnet_psk) == 64
    assert key.pnet_psk != SwarmKey(OTHER).pnet_psk
    with pytest.raises(SwarmKeyError, match=r"must be 32-1024 bytes"):
        SwarmKey(SECRET[:31])


# ----------------------------------------------------------------------------- tags


def test_a_tag_verifies_only_under_the_same_key_and_the_same_bytes():
    key = SwarmKey(SECRET)
    tag = key.tag(b"record")
    assert key.verify(b"record", tag)
    assert SwarmKey(SECRET).verify(b"record", tag)  # the derivation is deterministic
    assert not SwarmKey(OTHER).verify(b"record", tag)  # a wrong key
    assert not key.verify(b"record!", tag)  # other bytes: a tag replayed elsewhere
    assert not key.verify(b"record", tag[:31])  # truncated
    assert not key.verify(b"record", tag + b"\0")
    assert not key.verify(b"record", None)
    assert not key.verify(b"record", tag.hex())
    assert not key.verify(b"record", bytes(32))


class FakeDht:
    """What SwarmDirectory asks of the DHT client: store and get (subkey, value, expiry)."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, tuple[bytes, float]]] = {}

    def store(self, key, subkey, value, expiration) -> bool:
        self.entries.setdefault(key, {})[subkey] = (value, expiration)
        return True

    def get(self, key):
        return [(s, v, e) for s, (v, e) in self.entries.get(key, {}).items()]


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return [Identity(tmp_path_factory.mktemp(name) / "key") for name in ("a", "b", "c")]


def _directory(dht, who, key):
    return SwarmDirectory(dht, swarm="demo", peer_id=who.peer_id, sign=who.sign, auth=key)


def test_a_keyed_directory_sees_only_records_and_proposals_tagged_with_its_key(three):
    member, stranger, wrong = three
    dht = FakeDht()
    mine = _directory(dht, member, SwarmKey(SECRET))
    for who, key in ((member, SwarmKey(SECRET)), (stranger, None), (wrong, SwarmKey(OTHER))):
        directory = _directory(dht, who, key)
        assert directory.announce(node_info(who.peer_id), ttl_s=30)
        assert directory.propose(plan_proposal(who.peer_id), ttl_s=30)
    assert list(mine.members()) == [member.peer_id]
    assert [p.proposer for p in mine.proposals(5)] == [member.peer_id]
    assert mine.skipped == 4
    # An open directory (no key) reads only the open record: the keyed ones are sealed.
    open_directory = _directory(dht, stranger, None)
    assert list(open_directory.members()) == [stranger.peer_id]
    assert [p.proposer for p in open_directory.proposals(5)] == [stranger.peer_id]
    assert open_directory.skipped == 4


def test_a_members_tag_replayed_on_another_record_is_refused(three):
    member, stranger, _ = three
    dht = FakeDht()
    key = SwarmKey(SECRET)
    mine = _directory(dht, member, key)
    mine.announce(node_info(member.peer_id), ttl_s=30)
    # The member's tag, as if leaked (a stranger cannot read it: the value is sealed).
    mac = msgpack.unpackb(RecordCipher(key.records).open(dht.get(nodes_key("demo"))[0][1]))["mac"]
    # The stranger signs its own record, attaches the member's tag and seals it, as if the
    # seal's key had leaked too: the tag still binds the member's signed bytes.
    forged = msgpack.unpackb(
        seal(
            node_info(stranger.peer_id),
            key=nodes_key("demo"),
            subkey=stranger.peer_id,
            expiration=2e9,
            sign=stranger.sign,
        )
    )
    forged["mac"] = mac
    forged_value = RecordCipher(key.records).seal(msgpack.packb(forged))
    dht.store(nodes_key("demo"), stranger.peer_id, forged_value, 2e9)
    # ... and replays the member's own proposal envelope under another epoch's key.
    mine.propose(plan_proposal(member.peer_id), ttl_s=30)
    value, expiration = dht.entries[plans_key("demo", 5)][member.peer_id]
    dht.store(plans_key("demo", 6), member.peer_id, value, expiration)
    assert list(mine.members()) == [member.peer_id]
    assert mine.proposals(6) == []
    assert mine.skipped == 2


def test_an_envelope_mac_must_be_32_bytes(three):
    member = three[0]
    sealed = seal(node_info(member.peer_id), key="k", subkey=member.peer_id, expiration=1e9,
                  sign=member.sign, tag=SwarmKey(SECRET).tag)  # fmt: skip
    fields = msgpack.unpackb(sealed)
    assert open_envelope(sealed).mac == fields["mac"]
    for bad in (fields["mac"][:16], None, "text", 7):
        with pytest.raises(RecordError, match=r"record mac malformed"):
            open_envelope(msgpack.packb({**fields, "mac": bad}))
    renamed = {k: v for k, v in fields.items() if k != "mac"} | {"tag": fields["mac"]}
    with pytest.raises(RecordError, match=r"wrong fields"):
        open_envelope(msgpack.packb(renamed))


# ----------------------------------------------------------------------------- settings


def test_the_key_digest_joins_the_settings_digest(tmp_path):
    open_swarm = SwarmSettings()
    keyed = SwarmSettings(key_digest=SwarmKey(SECRET).digest)
    other = SwarmSettings(key_digest=SwarmKey(OTHER).digest)
    assert len({open_swarm.digest(), keyed.digest(), other.digest()}) == 3
    with pytest.raises(ConfigError, match=r"key_digest must be 16 hex digits or empty"):
        SwarmSettings(key_digest=SECRET.hex())
    with pytest.raises(ConfigError, match=r"is not the swarm key's digest"):
        NodeConfig(key_path=tmp_path / "k", swarm_key=SwarmKey(SECRET), settings=other)
    with pytest.raises(ConfigError, match=r"is not the swarm key's digest ''"):
        NodeConfig(key_path=tmp_path / "k", settings=keyed)
    node = NodeConfig(key_path=tmp_path / "k", swarm_key=SwarmKey(SECRET), settings=keyed)
    assert node.host_config().swarm_key.digest == keyed.key_digest


def test_the_keygen_command_writes_once_and_node_refuses_a_readable_key(tmp_path, capsys):
    from fusionllm.node.cli.main import main

    path = tmp_path / "ours.swarm"
    assert main(["keygen", "--swarm-key", str(path)]) == 0
    assert f"digest {load_swarm_key(path).digest}" in capsys.readouterr().out
    assert main(["keygen", "--swarm-key", str(path)]) == 1
    assert "exists; not replacing it" in capsys.readouterr().err
    path.chmod(0o640)
    argv = ["node", "--swarm-key", str(path), "--key", str(tmp_path / "id"), "--no-train"]
    assert main(argv) == 1  # before the node starts anything
    assert "group or others may access it (mode 640)" in capsys.readouterr().err


def test_status_reads_with_the_swarm_key_and_refuses_a_readable_one(tmp_path, capsys, monkeypatch):
    import fusionllm.node.control.status as status_module
    from fusionllm.node.cli.main import main

    path = tmp_path / "ours.swarm"
    written = write_swarm_key(path)
    given = []

    def gather(bootstrap, swarm, *, timeout_s, swarm_key):  # the DHT read, faked
        given.append(swarm_key)
        return {"swarm": swarm, "peers": []}

    monkeypatch.setattr(status_module, "gather", gather)
    boot = ["--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x"]
    assert main(["status", *boot, "--swarm-key", str(path), "--json"]) == 0
    assert [k.digest for k in given] == [written.digest]
    capsys.readouterr()
    path.chmod(0o640)
    for extra in ([], ["--serve", "127.0.0.1:0"]):  # --serve: before it listens or reads
        assert main(["status", *boot, "--swarm-key", str(path), *extra]) == 1
        assert "group or others may access it (mode 640)" in capsys.readouterr().err
    assert len(given) == 1


# ----------------------------------------------------------------------------- the DHT worker


def test_the_worker_refuses_to_keep_records_without_the_swarms_tag(three):
    from fusionllm.dht.record_rules import RecordRules
    from tests.unit.test_record_rules import NOW, Clock, info, key_id, proposal

    member, stranger, wrong = three
    rules = RecordRules("demo", max_ttl_s=60, key_id=key_id, clock=Clock(),
                        tags=SwarmKey(SECRET).records)  # fmt: skip

    def store(who, record, key, swarm_key, *, tag=True):
        value = seal(record, key=key, subkey=who.peer_id, expiration=NOW + 10, sign=who.sign,
                     tag=swarm_key.tag if swarm_key and tag else None)  # fmt: skip
        if swarm_key is not None:
            value = RecordCipher(swarm_key.records).seal(value)
        return rules.check(key_id(key), who.peer_id, value, NOW + 10)

    ours = SwarmKey(SECRET)
    assert store(member, info(member.peer_id), nodes_key("demo"), ours)
    assert store(member, proposal(member.peer_id), plans_key("demo", 7), ours)
    for who, swarm_key, match in (
        (stranger, None, r"record is not sealed"),
        (wrong, SwarmKey(OTHER), r"does not open under this swarm's key"),
    ):
        with pytest.raises(UnsealedRecordError, match=match):
            store(who, info(who.peer_id), nodes_key("demo"), swarm_key)
        with pytest.raises(UnsealedRecordError, match=match):
            store(who, proposal(who.peer_id), plans_key("demo", 7), swarm_key)
    # Sealed under the swarm's key but untagged (a leaked seal key alone): still refused.
    with pytest.raises(RecordError, match=r"node record without this swarm's key"):
        store(stranger, info(stranger.peer_id), nodes_key("demo"), ours, tag=False)


def test_the_workers_tag_key_is_derived_checked_and_never_shown():
    from fusionllm.common.swarm_key import RecordTags
    from fusionllm.dht.client import DhtConfig

    key = SwarmKey(SECRET)
    hex_key = key.records.key_hex
    assert RecordTags.from_hex(hex_key).verify(b"x", key.tag(b"x"))
    assert SECRET.hex() != hex_key
    config = DhtConfig(swarm="demo", record_tag_key=hex_key)
    assert hex_key not in repr(config)
    assert config.worker_config()["record_tag_key"] == hex_key
    assert DhtConfig(swarm="demo").worker_config()["record_tag_key"] == ""
    for bad in ("00" * 31, "zz" * 32):
        with pytest.raises(SwarmKeyError, match=r"record tag key must be"):
            DhtConfig(swarm="demo", record_tag_key=bad)
