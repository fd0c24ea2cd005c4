"""A fake HTTP transport that answers like SGLang servers (no network, no GPU)."""

import json


class FakeResponse:
    def __init__(self, status_code=200, data=None):
        self.status_code = status_code
        self._data = data
        self.text = json.dumps(data)

    def json(self):
        return self._data


class FakeSession:
    """``post`` / ``get`` like ``requests.Session``.

    ``/generate``: row ``r`` (prompt ids ``p``) answers ``max_new_tokens`` tokens
    ``p[0] + 1, p[0] + 2, ...`` with log-prob ``-0.1 * (i + 1)``; a stop token ends it early.
    ``failures``: ``{path: [status_code or Exception, ...]}`` consumed before the normal answer.
    ``dead``: URLs whose /health fails; ``down``: URLs where every request fails (connection refused);
    ``hung``: URLs whose POSTs time out while /health answers (a wedged scheduler).
    """

    def __init__(self, failures=None, dead=(), down=(), hung=()):
        self.calls = []  # (method, url, json)
        self.headers = []  # the headers of each call (None when the client sent none)
        self.failures = {k: list(v) for k, v in (failures or {}).items()}
        self.dead = set(dead)
        self.down = set(down)
        self.hung = set(hung)

    def _fail(self, path):
        queue = self.failures.get(path)
        if queue:
            f = queue.pop(0)
            if isinstance(f, BaseException):
                raise f
            return FakeResponse(f, {"error": "injected"})
        return None

    def get(self, url, timeout=None, headers=None):
        self.calls.append(("GET", url, None))
        self.headers.append(headers)
        base, path = url.rsplit("/", 1)
        if base in self.down:
            raise ConnectionError("connection refused")
        if path == "health":
            if base in self.dead:
                raise ConnectionError("connection refused")
            return FakeResponse(200, None)
        return FakeResponse(404, {"error": "not found"})

    def post(self, url, json=None, timeout=None, headers=None):
        self.calls.append(("POST", url, json))
        self.headers.append(headers)
        path = "/" + url.split("/", 3)[-1]
        if url[:-len(path)] in self.down:
            raise ConnectionError("connection refused")
        if url[:-len(path)] in self.hung:
            raise TimeoutError(f"read timed out (timeout={timeout})")
        failed = self._fail(path)
        if failed is not None:
            return failed
        if path == "/generate":
            return FakeResponse(200, [self._gen(ids, sp)
                                      for ids, sp in zip(json["input_ids"], json["sampling_params"])])
        return FakeResponse(200, {"success": True, "message": "ok"})

    @staticmethod
    def _gen(ids, sp):
        stop = set(sp.get("stop_token_ids") or [])
        out, reason = [], "length"
        for i in range(sp["max_new_tokens"]):
            tok = ids[0] + i + 1
            out.append(tok)
            if tok in stop:
                reason = "stop"
                break
        triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(out)]
        return {"output_ids": out, "meta_info": {"finish_reason": {"type": reason},
                                                 "output_token_logprobs": triples}}

    def posts(self, path):
        return [(url, body) for m, url, body in self.calls if m == "POST" and url.endswith(path)]


class FakeProcess:
    """A ``subprocess.Popen`` stand-in whose exit code we control."""

    def __init__(self, returncode=None):
        self.returncode = returncode
        self.pid = -1

    def poll(self):
        return self.returncode
