// durably console: approval forms. A run's open ctx.wait_for(name, schema=...) is rendered from the JSON Schema its
// wait record holds (the waiting step's output.schema): one field per property, approve/deny for a plain bool, a
// JSON textarea for anything else (and for waits recorded without a schema). The value goes to
// POST /api/runs/{run}/submit, which checks it against the same JSON Schema before it sends the signal.
// Loaded before app.js; it uses app.js's h(), api(), errorBanner(), pathText() and fmtTime() when called.
"use strict";

// The form of every open wait of `run`, kept across re-renders (kit.cache) so what a person typed stays.
// kit: { cache: Map, dialog(title, body, label, danger, onSubmit), done(text) }.
function waitForms(run, kit) {
  const ended = new Set(["completed", "failed", "cancelled"]);
  const waits = ended.has(run.status) ? [] : run.steps.filter((st) => st.status === "waiting" && st.output
    && (st.label === "ctx.wait_for" && st.output.signal || st.label === "ctx.awakeable" && st.output.awakeable));
  const keep = new Set();
  const nodes = waits.map((st) => {
    const key = `${run.run_id} ${pathText(st.path)} ${st.output.signal || st.output.awakeable} ${JSON.stringify(st.output.schema || null)}`;
    keep.add(key);
    if (!kit.cache.has(key)) kit.cache.set(key, buildWaitForm(run.run_id, st, kit));
    return kit.cache.get(key);
  });
  for (const key of [...kit.cache.keys()]) if (!keep.has(key)) kit.cache.delete(key);
  if (!nodes.length) return null;
  return h("div", { class: "forms", "data-forms": "" }, h("h2", { style: "margin-top: 10px" }, "Waiting for input"), nodes);
}

// ---- reading a JSON Schema ---------------------------------------------------------------------------
function schemaAt(root, ref) {
  if (typeof ref !== "string" || !ref.startsWith("#")) return {};
  let node = root;
  for (const raw of ref.slice(1).split("/").filter(Boolean)) {
    const part = raw.replace(/~1/g, "/").replace(/~0/g, "~");
    if (!node || typeof node !== "object" || !(part in node)) return {};
    node = node[part];
  }
  return node && typeof node === "object" ? node : {};
}
// A schema with its $refs followed (sibling keywords such as a default or title kept).
function deref(root, node) {
  for (let i = 0; node && typeof node === "object" && typeof node.$ref === "string" && i < 32; i++) {
    const { $ref, ...rest } = node;
    node = Object.assign({}, schemaAt(root, $ref), rest);
  }
  return node && typeof node === "object" ? node : {};
}
// { schema, nullable }: `X | None` (anyOf/oneOf of X and null, or a type list with "null") as X, nullable.
function unwrapNull(root, node) {
  node = deref(root, node);
  const options = node.anyOf || node.oneOf;
  if (Array.isArray(options)) {
    const real = options.filter((o) => deref(root, o).type !== "null");
    if (real.length === 1 && real.length < options.length) {
      const { anyOf, oneOf, ...rest } = node;
      return { schema: Object.assign({}, deref(root, real[0]), rest.default !== undefined ? { default: rest.default } : {},
        rest.title ? { title: rest.title } : {}, rest.description ? { description: rest.description } : {}), nullable: true };
    }
  }
  if (Array.isArray(node.type) && node.type.includes("null")) {
    const rest = node.type.filter((t) => t !== "null");
    if (rest.length === 1) return { schema: Object.assign({}, node, { type: rest[0] }), nullable: true };
  }
  return { schema: node, nullable: false };
}
const isScalar = (v) => v === null || ["string", "number", "boolean"].includes(typeof v);
// Which input a schema gets: bool, enum, number, string, or json (objects, lists, unions: a JSON textarea).
function kindOf(schema) {
  if (Array.isArray(schema.enum) && schema.enum.length && schema.enum.every(isScalar)) return "enum";
  if ("const" in schema && isScalar(schema.const)) return "enum";
  if (schema.type === "boolean") return "bool";
  if (schema.type === "integer" || schema.type === "number") return "number";
  if (schema.type === "string") return "string";
  return "json";
}
// What the schema asks beyond its type, as a hint under the field (the server checks it).
function constraints(schema) {
  const out = [];
  if (schema.minimum !== undefined) out.push(`≥ ${schema.minimum}`);
  if (schema.exclusiveMinimum !== undefined) out.push(`> ${schema.exclusiveMinimum}`);
  if (schema.maximum !== undefined) out.push(`≤ ${schema.maximum}`);
  if (schema.exclusiveMaximum !== undefined) out.push(`< ${schema.exclusiveMaximum}`);
  if (schema.multipleOf !== undefined) out.push(`a multiple of ${schema.multipleOf}`);
  if (schema.minLength !== undefined) out.push(`at least ${schema.minLength} characters`);
  if (schema.maxLength !== undefined) out.push(`at most ${schema.maxLength} characters`);
  if (schema.pattern !== undefined) out.push(`matching ${schema.pattern}`);
  if (schema.format) out.push(schema.format === "date-time" ? "a time, e.g. 2026-05-01T12:00:00Z" : schema.format);
  return out.join(", ");
}

// One field: its element, and read() -> { value } | { skip: true } | { error }.
function makeField(root, name, node, required, label) {
  const { schema, nullable } = unwrapNull(root, node);
  const kind = kindOf(schema);
  const blank = !required || nullable;  // may be left empty: omitted (or null when it must be given)
  const empty = () => (required && nullable ? { value: null } : { skip: true });
  const has = schema.default !== undefined;
  const attrs = { name, "data-field": name, "aria-label": label };
  let input, read;
  if (kind === "bool" && !nullable) {  // a checkbox, starting at the default: always sent
    input = h("input", Object.assign({ type: "checkbox", checked: has ? schema.default === true : false }, attrs));
    read = () => ({ value: input.checked });
  } else if (kind === "bool" || kind === "enum") {
    const choices = kind === "bool" ? [true, false] : Array.isArray(schema.enum) ? schema.enum : [schema.const];
    const none = nullable || (!required && !has);  // an empty choice: null, or left out
    input = h("select", attrs, none ? h("option", { value: "" }, nullable && required ? "null" : "—") : null,
      choices.map((c) => h("option", { value: JSON.stringify(c), selected: has && JSON.stringify(schema.default) === JSON.stringify(c) },
        typeof c === "string" ? c : JSON.stringify(c))));
    read = () => (input.value === "" ? empty() : { value: JSON.parse(input.value) });
  } else if (kind === "number") {
    input = h("input", Object.assign({ type: "number", step: schema.type === "integer" ? "1" : "any", inputmode: "decimal",
      value: has && schema.default !== null ? String(schema.default) : null }, attrs));
    read = () => {
      if (input.validity && input.validity.badInput) return { error: "is not a number" };
      const text = input.value.trim();
      if (!text) return empty();
      const n = Number(text);
      return isFinite(n) ? { value: n } : { error: "is not a number" };
    };
  } else if (kind === "string") {
    input = h("input", Object.assign({ type: "text", autocomplete: "off", value: has && schema.default !== null ? String(schema.default) : null,
      placeholder: schema.format === "date-time" ? "2026-05-01T12:00:00Z" : null }, attrs));
    read = () => (input.value === "" ? empty() : { value: input.value });
  } else {
    input = h("textarea", Object.assign({ spellcheck: "false", placeholder: schema.type === "array" ? "[]" : "{}" }, attrs),
      has ? JSON.stringify(schema.default, null, 2) : "");
    read = () => {
      const text = input.value.trim();
      if (!text) return empty();
      try { return { value: JSON.parse(text) }; } catch (e) { return { error: `is not valid JSON: ${e.message}` }; }
    };
  }
  const hint = [schema.description, constraints(schema), kind === "json" ? "JSON" : ""].filter(Boolean).join(" · ");
  const el = h("label", { class: `field ${kind === "bool" && !nullable ? "check" : ""} ${kind === "json" ? "wide" : ""}`, "data-field-box": name },
    h("span", {}, label, required && !nullable ? h("b", { class: "req", title: "required" }, " *") : null), input,
    hint ? h("span", { class: "muted" }, hint) : null);
  return { name, el, input, read };
}

// ---- one wait's form ---------------------------------------------------------------------------------
function buildWaitForm(runId, st, kit) {
  // An awakeable (ctx.awakeable) is answered by its id through POST /api/awakeables/{id}, checked the same way.
  const awakeable = st.label === "ctx.awakeable" ? st.output.awakeable : null;
  const name = awakeable || st.output.signal, where = pathText(st.path);
  const root = st.output.schema;
  const problem = h("div", { class: "invalid", role: "alert", "data-form-problem": "" });
  const called = awakeable ? `ctx.awakeable(${st.output.name ? JSON.stringify(st.output.name) : ""}) ${awakeable}` : `ctx.wait_for(${JSON.stringify(name)})`;
  const title = h("div", { class: "heading" }, h("b", {}, called), h("code", { class: "muted" }, `at ${where}`),
    st.output.deadline ? h("span", { class: "muted" }, `until ${fmtTime(st.output.deadline)}`) : null);
  const box = h("div", { class: "wait-form", "data-form": name, "data-path": where });

  // Send the value; a refusal is shown in the form (and returned), with the field it names marked.
  async function post(value) {
    problem.replaceChildren();
    for (const el of box.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    try {
      if (awakeable) await api(`/api/awakeables/${encodeURIComponent(awakeable)}`, { value });
      else await api(`/api/runs/${encodeURIComponent(runId)}/submit`, { name, path: where, value });
      kit.done(`submitted ${JSON.stringify(name)}: ${JSON.stringify(value)}; the run continues`);
      box.setAttribute("data-sent", "");
      return null;
    } catch (err) {
      problem.replaceChildren(errorBanner(err));
      problem.firstChild.setAttribute("data-result", "submit-failed");
      if (err.field) {
        const bad = box.querySelector(`[data-field="${CSS.escape(err.field)}"]`);
        if (bad) { bad.setAttribute("aria-invalid", "true"); bad.focus(); }
      }
      return err;
    }
  }

  const top = root === undefined || root === null ? null : unwrapNull(root, root);
  if (top && !top.nullable && kindOf(top.schema) === "bool") {  // a plain bool: approve or deny
    const decide = (value) => kit.dialog(value ? `Approve ${JSON.stringify(name)}?` : `Deny ${JSON.stringify(name)}?`,
      h("p", {}, `Sends ${value} to ctx.wait_for(${JSON.stringify(name)}) at ${where}; the run continues with it.`),
      value ? "Approve" : "Deny", !value, async (shown) => {
        const refused = await post(value);
        if (refused) { shown.replaceChildren(errorBanner(refused)); return false; }
      });
    fill(box, title, top.schema.description ? h("p", { class: "muted" }, top.schema.description) : null,
      h("div", { class: "ops" },
        h("button", { type: "button", class: "primary", "data-op": "approve", onclick: () => decide(true) }, "Approve"),
        h("button", { type: "button", class: "danger", "data-op": "deny", onclick: () => decide(false) }, "Deny")),
      problem);
    return box;
  }

  let fields, collect;
  const described = top ? top.schema : {};
  if (top && described.type === "object" && described.properties && typeof described.properties === "object") {
    const required = new Set(described.required || []);
    fields = Object.entries(described.properties).map(([key, sub]) =>
      makeField(root, key, sub, required.has(key), deref(root, sub).title || key));
    collect = () => {
      const value = {};
      for (const f of fields) {
        const got = f.read();
        if (got.error) return { error: `${f.name} ${got.error}`, field: f };
        if (!got.skip) value[f.name] = got.value;
      }
      return { value };
    };
  } else {  // a scalar, a list, a union, or no schema at all (any JSON)
    const only = top ? makeField(root, "value", root, true, described.title || "value")
      : makeField({}, "value", {}, true, "value (JSON; no schema was recorded for this wait)");
    fields = [only];
    collect = () => {
      const got = only.read();
      if (got.error) return { error: `the value ${got.error}`, field: only };
      return { value: got.skip ? null : got.value };
    };
  }
  const submit = h("button", { type: "submit", class: "primary", "data-op": "submit" }, "Submit");
  const form = h("form", { novalidate: true, class: "fields", onsubmit: async (e) => {
    e.preventDefault();
    const got = collect();
    if (got.error) {
      problem.replaceChildren(h("div", { class: "banner bad", "data-result": "submit-invalid" }, got.error));
      got.field.input.setAttribute("aria-invalid", "true");
      return;
    }
    submit.disabled = true;
    await post(got.value);
    submit.disabled = false;
  } }, fields.map((f) => f.el), h("div", { class: "ops" }, submit));
  fill(box, title, described.description ? h("p", { class: "muted" }, described.description) : null, form, problem);
  return box;
}
