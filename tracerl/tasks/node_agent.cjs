// The node-chain-sum task's agent: a Node program outside the trainer's process that plays one
// rollout through tracerl's rollout API with the openai npm client.
// It reads one JSON line on stdin: {root, apiKey, model, group, question, examples,
// temperature, maxTokens}; opens a rollout (POST ROOT/v1/rollouts), asks the model under it,
// prints {"rollout_id", "answer"} as a line, then reads the score line {"reward", "metrics"}
// (reasoning-gym's scorer, run by the Python side), posts the reward, finishes the rollout and
// prints {"finished": true}. On an error it finishes the rollout as failed and exits 1.
const OpenAI = require("openai");
const readline = require("node:readline");

const lines = readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();

async function nextLine(what) {
  const { value, done } = await lines.next();
  if (done) throw new Error(`stdin closed before ${what}`);
  return JSON.parse(value);
}

async function post(root, apiKey, path, body) {
  const r = await fetch(`${root}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${apiKey}` },
    body: JSON.stringify(body),
  });
  const text = await r.text();
  if (!r.ok) throw new Error(`POST ${path}: HTTP ${r.status} ${text}`);
  return JSON.parse(text);
}

async function main() {
  const job = await nextLine("the job");
  const opened = await post(job.root, job.apiKey, "/v1/rollouts", {
    model: job.model, group: job.group, group_size: 1, metadata: { agent: "node" } });
  const id = opened.rollout_id;
  try {
    const client = new OpenAI({ baseURL: opened.base_url, apiKey: job.apiKey, maxRetries: 0 });
    const completion = await client.chat.completions.create({
      model: job.model,
      messages: [...job.examples, { role: "user", content: job.question }],
      temperature: job.temperature,
      max_tokens: job.maxTokens,
    });
    const answer = completion.choices[0].message.content || "";
    console.log(JSON.stringify({ rollout_id: id, answer }));
    const score = await nextLine("the score");
    await post(job.root, job.apiKey, `/v1/rollouts/${id}/reward`,
      { reward: score.reward, metrics: score.metrics });
    await post(job.root, job.apiKey, `/v1/rollouts/${id}/finish`, { status: "ok" });
    console.log(JSON.stringify({ finished: true }));
  } catch (e) {
    await post(job.root, job.apiKey, `/v1/rollouts/${id}/finish`,
      { status: "failed", error: String(e.stack || e).slice(0, 2000) }).catch(() => {});
    throw e;
  }
}

main().then(() => process.exit(0)).catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});
