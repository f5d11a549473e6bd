"""How to reach object storage: the job file's ``storage:`` section, on top of the usual
environment (``AWS_*`` variables and profiles, ``GOOGLE_APPLICATION_CREDENTIALS``)."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

LEASE_ENV = "BATCHGEN_LEASE_SECONDS"


class StorageOptions(BaseModel):
    """Every field is optional: without any, the cloud libraries' own configuration applies."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = None  # an S3-compatible store (MinIO, Ceph, R2): its URL
    region: str | None = None
    profile: str | None = None  # an AWS profile from ~/.aws/config
    anonymous: bool = False  # public buckets: send no credentials
    lease_seconds: PositiveFloat | None = None  # a bucket shard lock's lifetime without renewal
    retries: PositiveInt = 8  # attempts of a call whose failure is transient (throttling, 5xx, a dropped connection)
    retry_wait: PositiveFloat = 0.2  # seconds: the first backoff's ceiling, doubled at each retry (full jitter)
    retry_max_wait: PositiveFloat = 20.0  # seconds: the ceiling of any one backoff
    options: dict[str, Any] = Field(default_factory=dict)  # passed to s3fs / gcsfs as they are

    @property
    def lease(self) -> float:
        if self.lease_seconds is not None:
            return float(self.lease_seconds)
        return float(os.environ.get(LEASE_ENV) or 60.0)

    def fsspec_kwargs(self, protocol: str) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if protocol == "s3":
            client: dict[str, Any] = {}
            if self.endpoint_url:
                client["endpoint_url"] = self.endpoint_url
            if self.region:
                client["region_name"] = self.region
            if client:
                kw["client_kwargs"] = client
            if self.profile:
                kw["profile"] = self.profile
            if self.anonymous:
                kw["anon"] = True
        elif protocol == "gs":
            if self.endpoint_url:
                kw["endpoint_url"] = self.endpoint_url
            if self.anonymous:
                kw["token"] = "anon"
        return {**kw, **self.options}
