// The openai npm package as a harness for tests/test_conformance_harnesses.py: two turns of a
// tool conversation (the model calls `add`, then answers with its result), chat or Responses,
// streamed or not. Reads {baseURL, apiKey, model, api, stream, system, messages, items, tools}
// as JSON on stdin; prints {"contents": [...]} (the text each turn showed the user).
const OpenAI = require("openai");

function add(args) {
  const { a, b } = JSON.parse(args);
  return String(a + b);
}

async function chatTurn(client, req, stream) {
  if (!stream) {
    const r = await client.chat.completions.create(req);
    const m = r.choices[0].message;
    return { content: m.content || "", calls: m.tool_calls || [] };
  }
  const s = await client.chat.completions.create({ ...req, stream: true });
  let content = "";
  const calls = [];
  for await (const chunk of s) {
    const d = (chunk.choices[0] || {}).delta || {};
    content += d.content || "";
    for (const tc of d.tool_calls || []) {
      calls[tc.index] = calls[tc.index] || { id: tc.id, type: "function",
                                             function: { name: "", arguments: "" } };
      calls[tc.index].function.name += (tc.function && tc.function.name) || "";
      calls[tc.index].function.arguments += (tc.function && tc.function.arguments) || "";
    }
  }
  return { content, calls };
}

async function responsesTurn(client, req, stream) {
  let r;
  if (stream) {
    const s = await client.responses.create({ ...req, stream: true });
    for await (const event of s) if (event.type === "response.completed") r = event.response;
  } else {
    r = await client.responses.create(req);
  }
  const text = r.output.filter((o) => o.type === "message")
    .map((o) => o.content.map((p) => p.text).join("")).join("");
  return { id: r.id, content: text, calls: r.output.filter((o) => o.type === "function_call") };
}

async function main() {
  let raw = "";
  for await (const part of process.stdin) raw += part;
  const a = JSON.parse(raw);
  const client = new OpenAI({ baseURL: a.baseURL, apiKey: a.apiKey, maxRetries: 0 });
  const contents = [];
  if (a.api === "chat") {
    const req = { model: a.model, messages: a.messages, tools: a.tools, max_tokens: 40,
                  temperature: 0 };
    const first = await chatTurn(client, req, a.stream);
    contents.push(first.content);
    const call = first.calls[0];
    const messages = [...a.messages,
      { role: "assistant", content: first.content || null, tool_calls: first.calls },
      { role: "tool", tool_call_id: call.id, content: add(call.function.arguments) }];
    contents.push((await chatTurn(client, { ...req, messages, max_tokens: 16 }, a.stream)).content);
  } else {
    const tools = a.tools.map((t) => ({ type: "function", ...t.function }));
    const req = { model: a.model, instructions: a.system, input: a.items, tools,
                  max_output_tokens: 40, temperature: 0 };
    const first = await responsesTurn(client, req, a.stream);
    contents.push(first.content);
    const call = first.calls[0];
    const output = add(call.arguments);
    const next = { ...req, previous_response_id: first.id, max_output_tokens: 16,
                   input: [{ type: "function_call_output", call_id: call.call_id, output }] };
    contents.push((await responsesTurn(client, next, a.stream)).content);
  }
  process.stdout.write(JSON.stringify({ contents }));
}

main().catch((e) => { console.error(e); process.exit(1); });
