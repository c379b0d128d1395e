"""GenerationClient: the one client for realflow's gen server and for SGLang.

Every call has a timeout; a timeout or a refused connection raises
:class:`GenerationServerError` naming the server URL and the endpoint, and a
4xx/5xx answer raises it with the server's message (``/generate`` first waits out
429 "server full" answers for as long as its timeout allows).  In-memory weight updates
go through POSIX shared memory (:mod:`realflow.comm.shm`): only a JSON handle
travels over HTTP, never pickled tensors.
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Optional, Sequence

import requests

__all__ = ["GenerationClient", "GenerationServerError", "parse_prometheus", "encode_image_data"]


def encode_image_data(data: Any) -> Any:
    """``image_data`` as JSON carries it: bytes become base64 strings, lists stay lists (nested
    once: a batch's per-prompt lists), strings and None pass unchanged."""
    import base64

    if isinstance(data, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(data)).decode("ascii")
    if isinstance(data, (list, tuple)):
        return [encode_image_data(d) for d in data]
    if data is None or isinstance(data, str):
        return data
    raise TypeError(f"image_data: an image must be bytes, a base64 string or a data URL, got {type(data).__name__}")


class GenerationServerError(RuntimeError):
    """A gen server call failed; ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, status: Optional[int] = None, retry_after: Optional[float] = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, from a 429's Retry-After


def parse_prometheus(text: str) -> dict[str, float]:
    """``name value`` lines of Prometheus text (labels kept in the name; comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


class GenerationClient:
    """HTTP client of one generation server (``base_url`` like ``http://127.0.0.1:30000``)."""

    def __init__(self, base_url: str, timeout: float = 60.0,
                 generate_timeout: Optional[float] = 600.0, api_key: Optional[str] = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.generate_timeout = generate_timeout
        self._session = requests.Session()
        if api_key is not None:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ transport

    def _call(self, method: str, endpoint: str, body: Optional[dict[str, Any]] = None,
              timeout: Optional[float] = None, raw: bool = False, wait_if_full: bool = False) -> Any:
        """One call. ``wait_if_full``: a 429 (server full) is retried after its ``Retry-After``
        for as long as ``timeout`` allows; then it raises like any other 4xx."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + (t if t is not None else float("inf"))
        while True:
            try:
                return self._call_once(method, endpoint, body, t, raw)
            except GenerationServerError as e:
                if not (wait_if_full and e.status == 429 and e.retry_after is not None
                        and time.monotonic() + e.retry_after < deadline):
                    raise
                time.sleep(e.retry_after)
                if t is not None:
                    t = max(0.1, deadline - time.monotonic())

    def _call_once(self, method: str, endpoint: str, body: Optional[dict[str, Any]],
                   t: Optional[float], raw: bool) -> Any:
        url = self.base_url + endpoint
        try:
            resp = self._session.request(method, url, json=body, timeout=t)
        except requests.Timeout:
            raise GenerationServerError(f"gen server {self.base_url} did not answer {method} {endpoint} "
                                        f"within {t:.0f}s") from None
        except requests.ConnectionError as e:
            raise GenerationServerError(f"gen server {self.base_url} unreachable for {method} "
                                        f"{endpoint}: {e}") from None
        if resp.status_code >= 400:
            try:
                msg = resp.json().get("error") or resp.text
            except ValueError:
                msg = resp.text
            try:
                retry_after: Optional[float] = float(resp.headers["Retry-After"])
            except (KeyError, ValueError):
                retry_after = None
            raise GenerationServerError(f"gen server {self.base_url} {method} {endpoint} -> "
                                        f"{resp.status_code}: {msg}", resp.status_code, retry_after)
        if raw:
            return resp.text
        return resp.json()

    # ------------------------------------------------------------ API

    def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: Optional[Mapping[str, Any] | Sequence[Mapping[str, Any]]] = None,
                 return_logprob: bool = True, rid: Optional[str | list[str]] = None,
                 timeout: Optional[float] = None, return_routed_experts: Optional[bool] = None,
                 image_data: Any = None) -> Any:
        """SGLang ``/generate``: an object for one prompt with n == 1, else a list.

        ``return_routed_experts`` (MoE models; None: the server's default) asks for
        ``meta_info["routed_experts"]``, read with :func:`realflow.api.routing.decode_routed_experts`.
        ``image_data`` (vision-language models): one prompt's images (an image or a list), or for a
        batch one entry per prompt (an image, a list, or None); an image is encoded bytes (sent as
        base64), a base64 string or a data URL (:func:`encode_image_data`)."""
        body: dict[str, Any] = {"input_ids": [list(map(int, p)) for p in input_ids]
                                if input_ids and not isinstance(input_ids[0], int)
                                else list(map(int, input_ids)),
                                "return_logprob": return_logprob}
        if sampling_params is not None:
            body["sampling_params"] = (list(map(dict, sampling_params))
                                       if isinstance(sampling_params, (list, tuple))
                                       else dict(sampling_params))
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts is not None:
            body["return_routed_experts"] = bool(return_routed_experts)
        if image_data is not None:
            body["image_data"] = encode_image_data(image_data)
        return self._call("POST", "/generate", body,
                          timeout if timeout is not None else self.generate_timeout, wait_if_full=True)

    def update_weights_from_disk(self, model_path: str, weight_version: Optional[int] = None,
                                 timeout: Optional[float] = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/update_weights_from_disk", body, timeout)

    def update_weights_from_tensors(self, tensors: Mapping[str, Any], fmt: str = "hf",
                                    weight_version: Optional[int] = None,
                                    timeout: Optional[float] = None, stage: bool = False) -> dict[str, Any]:
        """Send ``tensors`` (HF names and full shapes for ``fmt="hf"``) through shared memory.

        ``stage=True``: the server builds them beside its weights while it keeps generating;
        :meth:`commit_staged_weights` swaps them in.  The server must be on this host.
        If the call fails the segment is released here.
        """
        from realflow.comm.shm import put_tensors, release

        handle = put_tensors(dict(tensors))
        body: dict[str, Any] = {"shm_handle": handle, "format": fmt}
        if stage:
            body["stage"] = True
        if weight_version is not None:
            body["weight_version"] = weight_version
        try:
            return self._call("POST", "/update_weights_from_tensor", body, timeout)
        finally:
            release(handle)  # no-op when the server took it

    def commit_staged_weights(self, weight_version: Optional[int] = None) -> dict[str, Any]:
        body = {} if weight_version is None else {"weight_version": weight_version}
        return self._call("POST", "/commit_staged_weights", body)

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict[str, Any]:
        return self._call("POST", "/continue_generation", {})

    def flush_cache(self) -> dict[str, Any]:
        return self._call("POST", "/flush_cache", {})

    def abort_request(self, rid: str) -> dict[str, Any]:
        return self._call("POST", "/abort_request", {"rid": rid})

    def health(self, timeout: Optional[float] = None) -> dict[str, Any]:
        return self._call("GET", "/health", timeout=timeout)

    def is_healthy(self, timeout: float = 5.0) -> bool:
        try:
            return self.health(timeout).get("status") == "ok"
        except GenerationServerError:
            return False

    def model_info(self) -> dict[str, Any]:
        return self._call("GET", "/get_model_info")

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(self._call("GET", "/metrics", raw=True))
