// An outside service for tests/test_rollout_external*.py, in another language than the trainer:
// it opens two rollouts of one group on tracerl's gateway (POST /v1/rollouts), calls the model
// through each rollout's base_url, sets the rewards and finishes them. Only Node's fetch.
// Usage: node external_rollout_service.cjs GATEWAY_ROOT MODEL GROUP [API_KEY]
// Prints [{rollout_id, text, response_id}, ...] as JSON.
const [root, model, group, key] = process.argv.slice(2);
const auth = key ? { authorization: `Bearer ${key}` } : {};

async function post(url, body) {
  const r = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", ...auth },
    body: JSON.stringify(body),
  });
  const text = await r.text();
  if (!r.ok) throw new Error(`POST ${url}: HTTP ${r.status} ${text}`);
  return JSON.parse(text);
}

async function rollout(i) {
  const opened = await post(`${root}/v1/rollouts`,
    { model, group, group_size: 2, metadata: { service: "node", index: i } });
  const answer = await post(`${opened.base_url}/chat/completions`, {
    model, max_tokens: 8, temperature: 1.0,
    messages: [{ role: "user", content: `Say the number ${i}.` }],
  });
  const text = answer.choices[0].message.content || "";
  await post(`${root}/v1/rollouts/${opened.rollout_id}/reward`,
    { reward: i, metrics: { chars: text.length } });
  await post(`${root}/v1/rollouts/${opened.rollout_id}/finish`, { status: "ok" });
  return { rollout_id: opened.rollout_id, text, response_id: answer.id };
}

Promise.all([rollout(0), rollout(1)])
  .then((results) => console.log(JSON.stringify(results)))
  .catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
