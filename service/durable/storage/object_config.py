"""How an object store is reached: its endpoint and credentials, by the ecosystem's
conventions, for both clients that talk to it (obstore for the tier's files, TensorStore
for the arrays).

- **S3** (``s3://``): ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (absent: AWS
  itself); ``AWS_REGION``, else ``AWS_DEFAULT_REGION`` (default ``us-east-1``);
  credentials by the AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``, web identity as IRSA sets it, instance metadata). TensorStore
  ignores ``AWS_ENDPOINT_URL``: the endpoint goes into its spec.
- **GCS** (``gs://``): Google's application default credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, Workload Identity's metadata server);
  ``STORAGE_EMULATOR_HOST`` for an emulator (requests unsigned, as Google's own client
  libraries do for it), handed to TensorStore as ``TENSORSTORE_GCS_HTTP_URL`` (with the
  test token it needs) where those are not set already.

The decisions are pure (:func:`settings`: environment in, settings out); :func:`storage`
builds the clients from them, :func:`kvstore` TensorStore's spec.
"""

import dataclasses
import datetime
import os

#: obstore's retries (S3): a store that stops answering (restarted, cut off) is retried with
#: back-off for up to 20 s, then the call fails and says why (the writer logs it, leaves
#: the step unlisted and rests: policy.retry_after) rather than holding the writer's
#: thread for obstore's default three minutes on every call of a write.
_RETRY = {"max_retries": 8, "retry_timeout": datetime.timedelta(seconds=20),
          "backoff": {"init_backoff": datetime.timedelta(milliseconds=200),
                      "max_backoff": datetime.timedelta(seconds=8), "base": 2.0}}
_CLIENT = {"connect_timeout": "5s", "timeout": "120s"}
#: gcsfs's tries of a request (it backs off between them, up to 32 s).
_GCS_RETRIES = 6


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """Where a store answers and how requests are signed."""

    endpoint: str | None
    region: str | None = None
    unsigned: bool = False
    #: Keys in the environment: TensorStore is told to take them from there (its
    #: default chain also reads ~/.aws and logs an error for each file missing).
    keys_in_environment: bool = False


def s3_settings(env) -> Settings:
    """The S3 endpoint and region ``env`` (the environment) names."""
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    return Settings(endpoint=endpoint and endpoint.rstrip("/"), region=region,
                    keys_in_environment=bool(env.get("AWS_ACCESS_KEY_ID")))


def gcs_settings(env) -> Settings:
    """The GCS endpoint ``env`` names: an emulator's (unsigned), else Google's."""
    emulator = env.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return Settings(endpoint=None)
    if "://" not in emulator:
        emulator = f"http://{emulator}"
    return Settings(endpoint=emulator.rstrip("/"), unsigned=True)


def settings(scheme: str, env) -> Settings:
    """The settings of ``scheme``'s store in ``env``."""
    return s3_settings(env) if scheme == "s3" else gcs_settings(env)


def storage(scheme: str, bucket: str, s: Settings):
    """The storage of ``bucket``: its client (credentials from the environment, by the
    ecosystem's chain) and TensorStore's spec."""
    from bubblesnap.service.durable.storage import objects

    if scheme == "s3":
        from obstore.store import S3Store

        config = {"region": s.region}
        if s.endpoint:
            config |= {"endpoint": s.endpoint, "allow_http": s.endpoint.startswith("http:")}
        return objects.S3Storage(bucket, S3Store(
            bucket, config=config, client_options=_CLIENT, retry_config=_RETRY),
            kvstore(scheme, bucket, s))
    try:
        # the JSON-API filesystem itself: gcsfs's default class first asks a bucket's type
        # over Google's gRPC control API (which an emulator lacks: a minute's wait)
        from gcsfs.core import GCSFileSystem
    except ImportError as err:
        raise ImportError("gs:// durable storage goes through gcsfs: pip install "
                          "'bubblesnap[gcs]'") from err
    # the emulator's host from the environment (gcsfs reads STORAGE_EMULATOR_HOST too);
    # unsigned there, Google's application default credentials elsewhere
    fs = GCSFileSystem(token="anon" if s.unsigned else None, endpoint_url=s.endpoint,
                             skip_instance_cache=True, use_listings_cache=False,
                             retries=_GCS_RETRIES)
    return objects.GcsStorage(bucket, fs, kvstore(scheme, bucket, s))


def kvstore(scheme: str, bucket: str, s: Settings) -> dict:
    """TensorStore's kvstore spec of ``bucket`` (without its path)."""
    if scheme == "s3":
        spec = {"driver": "s3", "bucket": bucket, "aws_region": s.region}
        if s.endpoint:
            spec["endpoint"] = s.endpoint
        if s.keys_in_environment:
            spec["aws_credentials"] = {"type": "environment"}
        return spec
    if s.endpoint:  # TensorStore reads these, not STORAGE_EMULATOR_HOST
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", s.endpoint)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    return {"driver": "gcs", "bucket": bucket}
