"""The one web page of `trainer serve`: type ingredients (and a title, for a title-to-recipe model), read the
recipe as the model writes it (POST /generate with "stream": true, read as server-sent events), then set out
as title, ingredients and numbered directions. Self-contained: no script or style is fetched from elsewhere.
"""

from __future__ import annotations

import html

from trainer.data.prompt import PromptTemplate

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Recipe model</title>
<style>
  body { font: 16px/1.5 system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
         color: #222; background: #fafafa; }
  h1 { font-size: 1.5rem; margin-bottom: .2rem; }
  .model { color: #666; font-size: .85rem; margin-top: 0; word-break: break-all; }
  label { display: block; font-weight: 600; margin: .8rem 0 .3rem; }
  textarea, input[type=text] { width: 100%; box-sizing: border-box; font: inherit; padding: .5rem;
         border: 1px solid #bbb; border-radius: 6px; }
  details { margin: .8rem 0; }
  .options { display: grid; grid-template-columns: repeat(auto-fill, minmax(11rem, 1fr)); gap: .5rem 1rem; }
  .options label { font-weight: 400; margin: 0; }
  .options input[type=number] { width: 6rem; }
  button { font: inherit; padding: .5rem 1.4rem; border: 0; border-radius: 6px; background: #2f6f3e;
           color: white; cursor: pointer; }
  button:disabled { background: #999; cursor: default; }
  #status { margin-left: 1rem; color: #666; }
  #error { color: #b00020; white-space: pre-wrap; }
  #stream { white-space: pre-wrap; background: white; border: 1px solid #ddd; border-radius: 6px;
            padding: .8rem; min-height: 3rem; }
  #recipe { background: white; border: 1px solid #ddd; border-radius: 6px; padding: .2rem 1.2rem 1rem; }
  [hidden] { display: none !important; }
</style>
</head>
<body>
<h1>Recipe model</h1>
<p class="model">__MODEL__ &middot; prompt: <code>__PROMPT__</code></p>
<form id="form">
  <div __TITLE_HIDDEN__>
    <label for="title">Title</label>
    <input type="text" id="title" placeholder="Lemon pancakes">
  </div>
  <div __INGREDIENTS_HIDDEN__>
    <label for="ingredients">Ingredients, one per line (or separated by ";")</label>
    <textarea id="ingredients" rows="6"
              placeholder="2 eggs&#10;1 cup flour&#10;1 cup milk&#10;1 lemon"></textarea>
  </div>
  <details>
    <summary>Decoding (Hugging Face's options; empty: the server's defaults)</summary>
    <div class="options">
      <label>max_new_tokens <input type="number" id="max_new_tokens" min="1"></label>
      <label>num_beams <input type="number" id="num_beams" min="1"></label>
      <label>temperature <input type="number" id="temperature" step="0.05" min="0.05"></label>
      <label>top_p <input type="number" id="top_p" step="0.05" min="0.05" max="1"></label>
      <label>top_k <input type="number" id="top_k" min="1"></label>
      <label>repetition_penalty <input type="number" id="repetition_penalty" step="0.05" min="0.05"></label>
      <label>no_repeat_ngram_size <input type="number" id="no_repeat_ngram_size" min="0"></label>
      <label><input type="checkbox" id="do_sample"> do_sample</label>
    </div>
  </details>
  <button id="go" type="submit">Write the recipe</button><span id="status"></span>
</form>
<p id="error" hidden></p>
<h2 id="stream-heading" hidden>Written so far</h2>
<div id="stream" hidden></div>
<div id="recipe" hidden>
  <h2 id="recipe-title"></h2>
  <h3>Ingredients</h3><ul id="recipe-ingredients"></ul>
  <h3>Directions</h3><ol id="recipe-directions"></ol>
</div>
<script>
const $ = (id) => document.getElementById(id);
const NUMBERS = ["max_new_tokens", "num_beams", "temperature", "top_p", "top_k", "repetition_penalty",
                 "no_repeat_ngram_size"];

function request() {
  const body = { stream: true };
  const items = $("ingredients").value.split(/[\\n;]/).map((s) => s.trim()).filter((s) => s);
  if (items.length) body.ingredients = items;
  if ($("title").value.trim()) body.title = $("title").value.trim();
  for (const name of NUMBERS) {
    if ($(name).value !== "") body[name] = Number($(name).value);
  }
  if ($("do_sample").checked) body.do_sample = true;
  return body;
}

function show(row) {
  $("stream").textContent = row.generated;
  if (!row.title && !row.ingredients && !row.directions) return;  // not in the template's shape: raw text
  $("recipe-title").textContent = row.title || "(no title)";
  const lists = [["recipe-ingredients", row.ingredients], ["recipe-directions", row.directions]];
  for (const [id, items] of lists) {
    $(id).replaceChildren(...(items || []).map((text) => {
      const li = document.createElement("li");
      li.textContent = text;
      return li;
    }));
  }
  $("recipe").hidden = false;
}

async function generate(event) {
  event.preventDefault();
  $("go").disabled = true;
  $("error").hidden = $("recipe").hidden = true;
  $("stream").textContent = "";
  $("stream").dataset.tokens = 0;  // how many pieces arrived (tests read it)
  $("stream").hidden = $("stream-heading").hidden = false;
  $("status").textContent = "writing…";
  try {
    const response = await fetch("generate", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request()),
    });
    if (!response.ok) throw new Error((await response.json()).error || response.statusText);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const kind = (block.match(/^event: (.*)$/m) || [])[1];
        const data = JSON.parse((block.match(/^data: (.*)$/m) || [])[1] || "null");
        if (kind === "token") {
          $("stream").textContent += data.delta;
          $("stream").dataset.tokens = Number($("stream").dataset.tokens) + 1;
        }
        if (kind === "done") { show(data); $("status").textContent = "done"; }
        if (kind === "error") throw new Error(data.error);
      }
    }
  } catch (e) {
    $("error").textContent = e.message;
    $("error").hidden = false;
    $("status").textContent = "";
  } finally {
    $("go").disabled = false;
  }
}

$("form").addEventListener("submit", generate);
</script>
</body>
</html>
"""


def page(template: PromptTemplate, needs: set[str], model: str = "") -> str:
    """The page for a model whose prompt is `template`, rendered from the record fields `needs`."""
    return (
        _PAGE.replace("__MODEL__", html.escape(model))
        .replace("__PROMPT__", html.escape(template.source_template))
        .replace("__TITLE_HIDDEN__", "" if "title" in needs else "hidden")
        .replace("__INGREDIENTS_HIDDEN__", "" if "ingredients" in needs else "hidden")
    )
