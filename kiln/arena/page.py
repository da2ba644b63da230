"""The arena's one HTML page (plain HTML, CSS and JavaScript; no build step, nothing fetched from elsewhere).

It asks /api/round for a prompt and two unnamed answers, posts the vote to /api/vote, then shows both names and
the ratings table until the person asks for the next prompt. Served by kiln.arena.app at GET /.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Kiln arena</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
  h1 { font-size: 1.4rem; margin-bottom: 0.2rem; }
  .sub { color: #666; margin-top: 0; }
  #prompt { background: #f4f4f8; border-left: 4px solid #556; padding: 0.8rem 1rem; white-space: pre-wrap; }
  .answers { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; margin: 1rem 0; }
  .answer { border: 1px solid #ccc; border-radius: 6px; padding: 0.8rem 1rem; min-height: 6rem; }
  .answer h2 { font-size: 1rem; margin: 0 0 0.5rem 0; }
  .answer.won { border: 2px solid #2a7; background: #f2fbf6; }
  .text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.9rem; }
  .name { color: #2a5; font-weight: bold; }
  .buttons button, #next { font-size: 1rem; padding: 0.5rem 1rem; margin-right: 0.5rem; cursor: pointer; }
  .buttons button:disabled { cursor: default; opacity: 0.5; }
  #next { background: #335; color: white; border: none; border-radius: 4px; }
  table { border-collapse: collapse; margin-top: 1rem; }
  th, td { border-bottom: 1px solid #ddd; padding: 0.3rem 0.8rem; text-align: right; }
  th:nth-child(2), td:nth-child(2) { text-align: left; }
  #status { color: #a33; }
</style>
</head>
<body>
<h1>Kiln arena</h1>
<p class="sub">Two models answer the same prompt; their names stay hidden until you vote.
  <span id="count"></span></p>
<div id="prompt">loading...</div>
<div class="answers">
  <div class="answer" id="box-left"><h2>Model 1 <span class="name" id="name-left"></span></h2>
    <div class="text" id="answer-left"></div></div>
  <div class="answer" id="box-right"><h2>Model 2 <span class="name" id="name-right"></span></h2>
    <div class="text" id="answer-right"></div></div>
</div>
<div class="buttons" id="buttons">
  <button id="vote-left" data-vote="left">&larr; Left is better</button>
  <button id="vote-tie" data-vote="tie">Tie</button>
  <button id="vote-both_bad" data-vote="both_bad">Both are bad</button>
  <button id="vote-right" data-vote="right">Right is better &rarr;</button>
</div>
<p id="status"></p>
<div id="after" hidden>
  <button id="next">Next prompt</button>
  <h2>Ratings</h2>
  <p class="sub" id="method"></p>
  <table id="ratings"><thead><tr><th>#</th><th>model</th><th>rating</th><th>95% interval</th><th>votes</th>
    <th>wins</th><th>losses</th><th>ties</th></tr></thead><tbody></tbody></table>
</div>
<script>
let round = null;
const $ = (id) => document.getElementById(id);
function setButtons(on) { document.querySelectorAll("#buttons button").forEach(b => b.disabled = !on); }

async function load() {
  $("status").textContent = "";
  $("after").hidden = true;
  setButtons(false);
  for (const side of ["left", "right"]) {
    $("name-" + side).textContent = ""; $("box-" + side).classList.remove("won");
    $("answer-" + side).textContent = "generating...";
  }
  const r = await fetch("/api/round");
  if (!r.ok) { $("status").textContent = "could not load a round: " + await r.text(); return; }
  round = await r.json();
  $("prompt").textContent = round.prompt;
  $("answer-left").textContent = round.answers[0] || "(empty answer)";
  $("answer-right").textContent = round.answers[1] || "(empty answer)";
  $("count").textContent = round.votes + " vote(s) so far.";
  setButtons(true);
}

function showRatings(ratings) {
  $("method").textContent = (ratings.method === "bt" ? "Bradley-Terry" : "Elo") + " ratings (1000 = average), " +
    ratings.votes + " vote(s), 95% interval (bootstrap; Bradley-Terry's Wald interval where the votes all agree).";
  const body = document.querySelector("#ratings tbody");
  body.innerHTML = "";
  ratings.rows.forEach((row, i) => {
    const tr = document.createElement("tr");
    for (const v of [i + 1, row.model, row.rating.toFixed(1), row.low.toFixed(1) + " to " + row.high.toFixed(1),
                     row.votes, row.wins, row.losses, row.ties]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    body.appendChild(tr);
  });
}

async function vote(choice) {
  setButtons(false);
  const r = await fetch("/api/vote", {method: "POST", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify({round: round.round, vote: choice})});
  if (!r.ok) { $("status").textContent = "vote not recorded: " + await r.text(); setButtons(true); return; }
  const out = await r.json();
  $("name-left").textContent = out.left; $("name-right").textContent = out.right;
  if (choice === "left" || choice === "right") $("box-" + choice).classList.add("won");
  $("count").textContent = out.ratings.votes + " vote(s) so far.";
  if (out.tracking !== "ok" && out.tracking !== "off") $("status").textContent = out.tracking;
  showRatings(out.ratings);
  $("after").hidden = false;
}

document.querySelectorAll("#buttons button").forEach(b => b.addEventListener("click", () => vote(b.dataset.vote)));
$("next").addEventListener("click", load);
load();
</script>
</body>
</html>
"""
