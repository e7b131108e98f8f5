"""A stand-in for a vLLM OpenAI-compatible server, for the client's tests without vLLM.

It answers the three calls the served teacher makes (``GET /v1/models``, ``POST /tokenize``,
``POST /v1/completions`` with token-id prompts and ``prompt_logprobs``) in vLLM's shapes, scoring
with a local HF model: per prompt position i >= 1 the top-k of log softmax(logits[i-1]) over
the tokenizer's vocabulary plus the actual token, each ``{logprob, rank, decoded_token}``. Faults
are switched on by attributes: ``mode`` (``ok``, ``malformed``, ``slow``, ``error500``),
``max_logprobs`` (vLLM's 400 above it), ``tokenize_shift`` (another tokenizer), ``stop_after``
(the server goes away after that many completions, as if killed), ``shared_prefix_shift`` (nats
taken off every log-prob of a prompt whose first half an earlier prompt of the same request
shares: prefix caching that changes ``prompt_logprobs``, vLLM #42245).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeVllm:
    def __init__(
        self, model, tokenizer, vocab_size: int, *, name: str = "teacher", root: str = "/models/tiny-teacher", max_model_len: int = 64
    ):
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.name, self.root, self.max_model_len = name, root, max_model_len
        self.mode, self.max_logprobs, self.tokenize_shift, self.stop_after = "ok", 64, 0, None
        self.slow_s = 5.0
        self.shared_prefix_shift = 0.0
        self.completions = 0  # completion requests answered
        self.prompts_seen: list[int] = []  # prompts per completion request
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int], k: int) -> list:
        x = torch.tensor([ids])
        logits = self.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :, : self.vocab_size].float()
        lp = torch.log_softmax(logits, -1)
        out: list = [None]
        for i in range(1, len(ids)):
            row = lp[i - 1]
            vals, top = row.topk(min(k, self.vocab_size))
            entry = {str(int(t)): {"logprob": float(v), "rank": r + 1, "decoded_token": ""} for r, (v, t) in enumerate(zip(vals, top))}
            actual = ids[i]
            if str(actual) not in entry:
                entry[str(actual)] = {"logprob": float(row[actual]), "rank": int((row > row[actual]).sum()) + 1, "decoded_token": ""}
            out.append(entry)
        return out

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # no access log on the test's stderr
                return

            def _send(self, code: int, obj) -> None:
                body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(
                        200, {"object": "list", "data": [{"id": fake.name, "root": fake.root, "max_model_len": fake.max_model_len}]}
                    )
                self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = list(fake.tokenizer(req["prompt"], add_special_tokens=False)["input_ids"])
                    ids = [(i + fake.tokenize_shift) % fake.vocab_size for i in ids]
                    return self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": fake.max_model_len})
                if self.path != "/v1/completions":
                    return self._send(404, {"error": {"message": "not found"}})
                if req.get("model") != fake.name:
                    return self._send(404, {"error": {"message": f"The model `{req.get('model')}` does not exist."}})
                k = int(req["prompt_logprobs"])
                if k > fake.max_logprobs:
                    msg = f"Requested prompt logprobs of {k}, which is greater than max allowed: {fake.max_logprobs}"
                    return self._send(400, {"error": {"message": msg, "type": "BadRequestError", "code": 400}})
                with fake._lock:
                    if fake.stop_after is not None and fake.completions >= fake.stop_after:
                        threading.Thread(target=fake.stop, daemon=True).start()  # killed: this and later requests fail
                        self.close_connection = True
                        return None
                    fake.completions += 1
                    fake.prompts_seen.append(len(req["prompt"]))
                if fake.mode == "slow":
                    time.sleep(fake.slow_s)
                if fake.mode == "error500":
                    return self._send(500, {"error": {"message": "EngineCore died"}})
                prompts = req["prompt"]
                choices = []
                for i, ids in enumerate(prompts):
                    plp = "garbage" if fake.mode == "malformed" else fake.prompt_logprobs(ids, k)
                    half = max(1, len(ids) // 2)
                    if fake.shared_prefix_shift and plp != "garbage" and any(p[:half] == ids[:half] for p in prompts[:i]):
                        for entry in plp[1:]:
                            for v in entry.values():
                                v["logprob"] -= fake.shared_prefix_shift
                    choices.append({"index": i, "text": "", "prompt_logprobs": plp, "finish_reason": "length"})
                self._send(200, {"object": "text_completion", "model": fake.name, "choices": choices})

        return Handler
