"""``/dashboard``: one self-contained HTML page (inline JS, plain canvas, no CDN) polling ``/v1/records``."""

DASHBOARD_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>twophase dashboard</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
canvas{background:#fff;border:1px solid #ddd;display:block;margin:6px 0 14px}
.figs span{display:inline-block;margin-right:22px}.figs b{font-size:18px}
.k1{color:#d9822b}.k2{color:#2b6cd9}
</style></head><body>
<h2>twophase &mdash; live steps</h2>
<div class="figs" id="figs">waiting for data&hellip;</div>
<div>tokens per step: <span class="k1">&#9632; prompt (prefill)</span> <span class="k2">&#9632; decode</span></div>
<canvas id="mix" width="1000" height="180"></canvas>
<div>step duration (ms)</div><canvas id="dur" width="1000" height="120"></canvas>
<div>KV cache usage (%)</div><canvas id="kv" width="1000" height="100"></canvas>
<script>
const MAX = 400, steps = [], reqs = [];
let sinceStep = -1, sinceReq = -1;
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const headers = key ? {Authorization: "Bearer " + key} : {};
function pct(a, q){ if(!a.length) return null; const s=[...a].sort((x,y)=>x-y); return s[Math.min(s.length-1, Math.floor(q*s.length))]; }
function fmt(v){ return v==null ? "&ndash;" : (v*1000).toFixed(1)+" ms"; }
function bars(id, series, colors){
  const c=document.getElementById(id), g=c.getContext("2d"); g.clearRect(0,0,c.width,c.height);
  const n=steps.length; if(!n) return; const w=c.width/MAX;
  const top=Math.max(1, ...steps.map(s=>series.reduce((t,f)=>t+f(s),0)));
  steps.forEach((s,i)=>{ let y=c.height; series.forEach((f,j)=>{ const h=f(s)/top*(c.height-14);
    g.fillStyle=colors[j]; g.fillRect(i*w, y-h, Math.max(1,w-1), h); y-=h; }); });
  g.fillStyle="#555"; g.fillText("max "+top.toFixed(top<10?2:0), 4, 11);
}
function draw(){
  bars("mix", [s=>s.num_prompt_tokens, s=>s.num_decode_tokens], ["#d9822b","#2b6cd9"]);
  bars("dur", [s=>s.duration*1000], ["#555"]);
  bars("kv", [s=>100*s.num_blocks_in_use/Math.max(1,s.num_blocks_total)], ["#3a9a5b"]);
  const ttft=reqs.map(r=>r.metrics.ttft).filter(v=>v!=null), tpot=reqs.map(r=>r.metrics.tpot).filter(v=>v!=null);
  document.getElementById("figs").innerHTML =
    `<span>requests <b>${reqs.length}</b></span><span>TTFT p50 <b>${fmt(pct(ttft,.5))}</b> p99 ${fmt(pct(ttft,.99))}</span>`+
    `<span>TPOT p50 <b>${fmt(pct(tpot,.5))}</b> p99 ${fmt(pct(tpot,.99))}</span>`;
}
async function poll(){
  try{
    const r=await fetch(`/v1/records?since_step=${sinceStep}&since_request=${sinceReq}`, {headers});
    if(r.ok){ const d=await r.json();
      d.steps.forEach(s=>{ steps.push(s); sinceStep=Math.max(sinceStep, s.step_id); });
      d.requests.forEach(q=>{ reqs.push(q); sinceReq=Math.max(sinceReq, q.seq); });
      steps.splice(0, Math.max(0, steps.length-MAX)); reqs.splice(0, Math.max(0, reqs.length-500)); draw(); }
  }catch(e){}
  setTimeout(poll, 1000);
}
poll();
</script></body></html>
"""
