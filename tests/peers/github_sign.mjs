// Signs a GitHub webhook body with GitHub's own library, @octokit/webhooks-methods:
//   node github_sign.mjs SECRET BODY_FILE     → {"X-Hub-Signature-256": "sha256=..."}
// (run from the npm directory webhook-peers.sh installed, where the package resolves).
import { readFileSync } from "node:fs";
import { sign, verify } from "@octokit/webhooks-methods";

const [secret, bodyFile] = process.argv.slice(2);
const body = readFileSync(bodyFile, "utf8");
const signature = await sign(secret, body);
if (!(await verify(secret, body, signature))) throw new Error("octokit does not verify its own signature");
console.log(JSON.stringify({ "X-Hub-Signature-256": signature }));
