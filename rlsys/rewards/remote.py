"""A reward model behind HTTP: POST a JSON batch, get one score per sample.

Request:  ``{"prompts": [...], "responses": [...], "answers": [...]}``
Response: ``{"scores": [float, ...]}`` (same order and length), or a bare JSON list of scores.

Config (``reward.kwargs``): ``url`` (required), ``timeout_s`` per attempt, ``retries`` after the first
attempt, ``backoff_s`` (doubled per retry), ``headers``. Server errors (5xx), 429 and connection
failures are retried; other 4xx are not, since the same request would fail again. A batch that
still fails raises, and ``RewardManager`` scores it 0 and counts the error. Plain ``urllib`` keeps
this dependency-free; proxies from the environment apply as for any client.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from rlsys.rewards.registry import register_reward


class RemoteRewardError(RuntimeError):
    pass


def post_json(url: str, body: dict, timeout_s: float, headers: dict | None = None):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _retryable(err: Exception) -> bool:
    if isinstance(err, urllib.error.HTTPError):
        return err.code >= 500 or err.code == 429
    return isinstance(err, (urllib.error.URLError, TimeoutError, ConnectionError))


@register_reward("remote", batched=True)
def remote_reward(
    responses: list[str],
    answers: list,
    prompts: list[str | None],
    url: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    headers: dict | None = None,
    **extra,
) -> list[float]:
    if not url:
        raise RemoteRewardError("the remote reward needs reward.kwargs.url")
    body = {"prompts": list(prompts), "responses": list(responses), "answers": list(answers)}
    for attempt in range(retries + 1):
        try:
            out = post_json(url, body, timeout_s, headers)
            break
        except Exception as e:  # noqa: BLE001 - decide below whether it is worth another try
            if attempt == retries or not _retryable(e):
                raise RemoteRewardError(f"reward server {url}: {e}") from e
            time.sleep(backoff_s * 2**attempt)
    scores = out.get("scores") if isinstance(out, dict) else out
    if not isinstance(scores, list) or len(scores) != len(responses):
        raise RemoteRewardError(f"reward server {url} must answer {len(responses)} scores, got {str(out)[:200]}")
    return scores
