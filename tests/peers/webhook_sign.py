#!/usr/bin/env python3
"""Signs a webhook body the way each platform does, with the vendor's own library.

    python webhook_sign.py slack|standard|discord SECRET BODY_FILE [TIMESTAMP] [ID]

Prints the headers as a JSON object. slack: slack_sdk's SignatureVerifier; standard: the
`standardwebhooks` library (SECRET is `whsec_...`); discord: PyNaCl with SECRET an Ed25519
seed in hex (the public key comes back as `_public_key`), checked with discord_interactions'
verify_key before it is printed. GitHub is signed by github_sign.mjs (@octokit/webhooks-methods).
"""
import json
import sys
import time
from datetime import datetime, timezone

provider, secret, body_file = sys.argv[1:4]
timestamp = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else str(int(time.time()))
message_id = sys.argv[5] if len(sys.argv) > 5 else "msg_keel_test"
body = open(body_file, "rb").read()

if provider == "slack":
    from slack_sdk.signature import SignatureVerifier

    headers = {
        "X-Slack-Request-Timestamp": timestamp,
        "X-Slack-Signature": SignatureVerifier(secret).generate_signature(timestamp=timestamp, body=body),
    }
elif provider == "standard":
    from standardwebhooks.webhooks import Webhook

    at = datetime.fromtimestamp(int(timestamp), tz=timezone.utc)
    headers = {
        "webhook-id": message_id,
        "webhook-timestamp": timestamp,
        "webhook-signature": Webhook(secret).sign(message_id, at, body.decode()),
    }
elif provider == "discord":
    from discord_interactions import verify_key
    from nacl.signing import SigningKey

    key = SigningKey(bytes.fromhex(secret))
    signature = key.sign(timestamp.encode() + body).signature.hex()
    public = key.verify_key.encode().hex()
    assert verify_key(body, signature, timestamp, public), "discord_interactions refuses the signature"
    headers = {"X-Signature-Ed25519": signature, "X-Signature-Timestamp": timestamp, "_public_key": public}
else:
    sys.exit(f"unknown provider {provider}")
print(json.dumps(headers))
