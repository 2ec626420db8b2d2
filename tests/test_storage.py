"""The durable tier's storage, without a server: which storage a path names, how an
object store is reached from the environment, the back-off after failed writes, and
Orbax's specs moved onto an object store. (tests/test_durable_object_store.py runs it all
against a real S3 server.)"""

import itertools

import pytest

from bubblesnap.service.durable import checkpoint, policy, storage
from bubblesnap.service.durable.storage import object_config


def test_a_path_names_a_folder_or_a_bucket():
    assert storage.at("/data/ckpt").renames
    assert storage.split_url("s3://bucket/a/b/") == ("s3", "bucket", "a/b")
    assert storage.split_url("gs://bucket") == ("gs", "bucket", "")
    assert storage.is_url("s3://b/x") and not storage.is_url("/s3://b")
    with pytest.raises(ValueError, match="s3://BUCKET"):
        storage.at("http://host/x")
    with pytest.raises(ValueError, match="names no bucket"):
        storage.at("s3:///prefix")


def test_s3_endpoint_region_and_keys_follow_the_aws_conventions():
    assert object_config.settings("s3", {}) == object_config.Settings(
        endpoint=None, region="us-east-1")
    env = {"AWS_ENDPOINT_URL": "http://generic:1/", "AWS_ENDPOINT_URL_S3": "http://s3:2",
           "AWS_DEFAULT_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "k"}
    s = object_config.settings("s3", env)
    assert (s.endpoint, s.region, s.keys_in_environment) == ("http://s3:2", "eu-west-1", True)
    s = object_config.settings("s3", {"AWS_ENDPOINT_URL": "http://generic:1/",
                                      "AWS_REGION": "ap-south-1"})
    assert (s.endpoint, s.region, s.keys_in_environment) == ("http://generic:1", "ap-south-1",
                                                             False)
    spec = object_config.kvstore("s3", "b", s)  # TensorStore ignores AWS_ENDPOINT_URL
    assert spec == {"driver": "s3", "bucket": "b", "aws_region": "ap-south-1",
                    "endpoint": "http://generic:1"}


def test_a_gcs_emulator_is_named_by_storage_emulator_host():
    assert object_config.settings("gs", {}).endpoint is None
    s = object_config.settings("gs", {"STORAGE_EMULATOR_HOST": "localhost:4443"})
    assert (s.endpoint, s.unsigned) == ("http://localhost:4443", True)


def test_failed_writes_back_off_doubling_to_a_bound():
    waits = [policy.retry_after(n) for n in range(8)]
    assert waits[0] == 0 and waits[1] == policy.RETRY_FIRST_SECONDS
    assert all(b == min(2 * a, policy.RETRY_MOST_SECONDS)
               for a, b in itertools.pairwise(waits[1:]))
    assert waits[-1] == policy.RETRY_MOST_SECONDS


def test_orbax_specs_are_moved_onto_the_object_store(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    folder = "s3://bucket/run/job/step_3"
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    spec = ts_utils.build_kvstore_tspec(checkpoint._orbax_path(folder), use_ocdbt=True)
    placed = checkpoint._placed(spec)
    assert placed["driver"] == "ocdbt"
    for key in ("base", "manifest"):
        assert placed[key] == {"driver": "s3", "bucket": "bucket", "aws_region": "us-east-1",
                               "endpoint": "http://127.0.0.1:9", "path": "run/job/step_3/"}
    local = ts_utils.build_kvstore_tspec("/data/job/step_3", use_ocdbt=True)
    assert checkpoint._placed(local) == local  # a folder's spec is Orbax's own
