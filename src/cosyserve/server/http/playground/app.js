// The cosyserve playground: plain JavaScript against the server's own HTTP API (docs/api.md).
//
// Audio streams as raw 16-bit PCM from fetch() into Web Audio, so it plays while it is made.
// (The WebSocket is not used: a browser cannot send it an Authorization header.)
"use strict";

const SAMPLE_RATE = 24000; // the PCM rate of /v1/audio/speech and upstream's routes
const LEAD_S = 0.05; // schedule each piece this far ahead of the audio clock
const $ = (id) => document.getElementById(id);

// The page's state; window.__playground shows what the last synthesis produced (tests read it).
const state = {
  voices: [], voiceLists: 0, current: null, player: null, last: null, recorder: null, recording: null,
};
const observed = { runs: 0, lastAudio: null, lastError: null };
window.__playground = observed;

// -- talking to the API -------------------------------------------------------------------------

function withKey(headers = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: withKey(init.headers) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

// The API answers errors as OpenAI's JSON: {"error": {"message": ...}}.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${body.error.message} (HTTP ${response.status})`;
  } catch (_) {
    // not JSON: fall through
  }
  return `HTTP ${response.status} ${response.statusText}`;
}

function say(text) {
  $("status").textContent = text;
}

function fail(error) {
  $("error").textContent = error.message;
  observed.lastError = error.message;
  say("");
}

function clearError() {
  $("error").textContent = "";
  observed.lastError = null;
}

// -- voices and modes ---------------------------------------------------------------------------

async function loadVoices(choose) {
  // Only the latest list counts: one asked with an older key may answer after it.
  const ticket = ++state.voiceLists;
  let voices;
  try {
    ({ voices } = await (await api("/v1/audio/voices")).json());
  } catch (error) {
    if (ticket === state.voiceLists) throw error;
    return;
  }
  if (ticket !== state.voiceLists) return;
  state.voices = voices;
  const select = $("voice");
  const before = select.value;
  const wanted = choose || before;
  select.replaceChildren();
  for (const [kind, label] of [["registered", "Registered"], ["builtin", "Built-in"]]) {
    const group = document.createElement("optgroup");
    group.label = label;
    for (const voice of voices.filter((v) => v.kind === kind)) {
      group.append(new Option(voice.name, voice.name));
    }
    if (group.children.length > 0) select.append(group);
  }
  if (voices.some((v) => v.name === wanted)) select.value = wanted;
  updateModes(select.value !== before);
}

// The served models (GET /v1/models): one option each, the server's default first. Upstream's
// per-mode routes always use the default model, so a mode only they serve needs it.
async function loadModels() {
  const { data } = await (await api("/v1/models")).json();
  const select = $("model");
  const before = select.value;
  select.replaceChildren(...data.map((model) => new Option(model.id, model.id)));
  if (data.some((model) => model.id === before)) select.value = before;
  $("model-field").hidden = data.length < 2;
}

function selectedVoice() {
  return state.voices.find((v) => v.name === $("voice").value);
}

// Only the modes the voice supports (the API lists them, its default first) can be chosen.
function updateModes(newVoice = false) {
  const modes = selectedVoice()?.modes ?? [];
  const select = $("mode");
  for (const option of select.options) option.disabled = !modes.includes(option.value);
  if (modes.length > 0 && (newVoice || select.selectedOptions[0]?.disabled)) select.value = modes[0];
  $("instruction-field").hidden = select.value !== "instruct2";
}

// /v1/audio/speech infers the mode: sft for a built-in speaker, zero-shot for a registered voice
// with a transcript (cross-lingual without), instruct2 with an instruction. Upstream's per-mode
// routes name the mode, for what it cannot infer: cross-lingual or sft with a voice that has a
// transcript. Those routes take no forced token count and answer only PCM.
function usesSpeechRoute(mode, voice) {
  if (mode === "instruct2") return true;
  let inferred = voice.modes.includes("zero_shot") ? "zero_shot" : "cross_lingual";
  if (voice.kind === "builtin") inferred = "sft";
  return mode === inferred;
}

function readForm() {
  const voice = selectedVoice();
  if (!voice) throw new Error("No voice to speak with: the voice list is empty or did not load.");
  const seed = $("seed").value.trim();
  const tokens = $("tokens").value.trim();
  return {
    text: $("text").value,
    voice,
    mode: $("mode").value,
    instruction: $("instruction").value,
    // Every request has a seed, so that the MP3 download repeats exactly what was heard.
    seed: seed === "" ? Math.floor(Math.random() * 2 ** 31) : Number(seed),
    tokens: tokens === "" ? null : Number(tokens),
  };
}

function speechRequest(form, format) {
  const body = {
    model: $("model").value || "default", input: form.text, voice: form.voice.name,
    response_format: format, stream: true, seed: form.seed,
  };
  if (form.mode === "instruct2") body.instructions = form.instruction;
  if (form.tokens !== null) Object.assign(body, { min_tokens: form.tokens, max_tokens: form.tokens });
  const headers = { "Content-Type": "application/json" };
  return ["/v1/audio/speech", { method: "POST", headers, body: JSON.stringify(body) }];
}

function upstreamRequest(form) {
  const fields = new FormData();
  fields.set("tts_text", form.text);
  fields.set("spk_id", form.voice.name);
  fields.set("seed", String(form.seed));
  return [`/inference_${form.mode}`, { method: "POST", body: fields }];
}

// -- streamed audio -----------------------------------------------------------------------------

// 16-bit little-endian PCM from network chunks, which may split a sample between them.
class PcmStream {
  constructor() {
    this.parts = [];
    this.length = 0;
    this.odd = null;
  }

  push(bytes) {
    let data = bytes;
    if (this.odd !== null) {
      data = new Uint8Array(bytes.length + 1);
      data[0] = this.odd;
      data.set(bytes, 1);
      this.odd = null;
    }
    if (data.length % 2 === 1) {
      this.odd = data[data.length - 1];
      data = data.subarray(0, data.length - 1);
    }
    const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
    const samples = new Int16Array(data.length / 2);
    for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true);
    this.parts.push(samples);
    this.length += samples.length;
    return samples;
  }

  all() {
    if (this.odd !== null) throw new Error("The audio stream ended in the middle of a sample.");
    const out = new Int16Array(this.length);
    let at = 0;
    for (const part of this.parts) {
      out.set(part, at);
      at += part.length;
    }
    return out;
  }
}

// Plays PCM pieces back to back as they arrive.
class Player {
  constructor(rate) {
    this.context = new AudioContext({ sampleRate: rate });
    this.next = 0;
    this.scheduledS = 0; // audio handed to Web Audio so far
  }

  play(samples) {
    const buffer = this.context.createBuffer(1, samples.length, this.context.sampleRate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < samples.length; i++) channel[i] = samples[i] / 32768;
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    this.next = Math.max(this.next, this.context.currentTime + LEAD_S);
    source.start(this.next);
    this.next += buffer.duration;
    this.scheduledS += buffer.duration;
  }

  close() {
    this.context.close().catch(() => {});
  }
}

function setBusy(busy) {
  $("speak").disabled = busy;
  $("stop").disabled = !busy;
  $("download-wav").disabled = busy || state.last === null;
  $("download-mp3").disabled = busy || state.last === null || !state.last.mp3;
}

function showTimings(audio) {
  $("ttfa").textContent = audio.firstAudioMs === null ? "no audio" : `${Math.round(audio.firstAudioMs)} ms`;
  $("duration").textContent = `${audio.seconds.toFixed(2)} s`;
  $("rtf").textContent = audio.seconds > 0 ? audio.rtf.toFixed(2) : "–";
  $("route").textContent = `${audio.mode} via ${audio.route}`;
}

async function speak(event) {
  event.preventDefault();
  clearError();
  stop();
  let form;
  try {
    form = readForm();
  } catch (error) {
    fail(error);
    return;
  }
  const speechRoute = usesSpeechRoute(form.mode, form.voice);
  const [path, init] = speechRoute ? speechRequest(form, "pcm") : upstreamRequest(form);
  // Made within the click: browsers let a page start audio on a user's gesture. A new run
  // silences the last one, also if that one is still playing what it received.
  state.player?.close();
  const current = { player: new Player(SAMPLE_RATE), controller: new AbortController() };
  state.current = current;
  state.player = current.player;
  setBusy(true);
  say("Synthesising…");
  const started = performance.now();
  let firstAudioMs = null;
  let pieces = 0; // played as they came: more than one when the server streamed chunks
  const pcm = new PcmStream();
  try {
    const response = await api(path, { ...init, signal: current.controller.signal });
    const reader = response.body.getReader();
    for (let read = await reader.read(); !read.done; read = await reader.read()) {
      const samples = pcm.push(read.value);
      if (samples.length === 0) continue;
      if (firstAudioMs === null) {
        firstAudioMs = performance.now() - started; // from sending the request to the first PCM
        $("ttfa").textContent = `${Math.round(firstAudioMs)} ms`;
      }
      current.player.play(samples);
      pieces += 1;
    }
    const samples = pcm.all();
    const wallMs = performance.now() - started;
    const seconds = samples.length / SAMPLE_RATE;
    const audio = {
      sampleRate: SAMPLE_RATE, samples: samples.length, seconds, firstAudioMs, wallMs, pieces,
      scheduledS: current.player.scheduledS, rtf: wallMs / 1000 / seconds,
      route: path, mode: form.mode, seed: form.seed,
    };
    state.last = { form, samples, mp3: speechRoute };
    observed.lastAudio = audio;
    showTimings(audio);
    say(`Done: ${seconds.toFixed(2)} s of audio (seed ${form.seed}).`);
  } catch (error) {
    if (error.name === "AbortError") say("Stopped.");
    else fail(error);
  } finally {
    if (state.current === current) state.current = null;
    setBusy(false);
    observed.runs += 1;
  }
}

function stop() {
  if (state.current === null) return;
  state.current.controller.abort();
  state.current.player.close();
}

// -- downloads ----------------------------------------------------------------------------------

function wavBlob(samples, rate) {
  const header = new DataView(new ArrayBuffer(44));
  const ascii = (at, text) => [...text].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  ascii(0, "RIFF");
  header.setUint32(4, 36 + samples.byteLength, true);
  ascii(8, "WAVE");
  ascii(12, "fmt ");
  header.setUint32(16, 16, true); // fmt chunk size
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, rate, true);
  header.setUint32(28, rate * 2, true); // bytes per second
  header.setUint16(32, 2, true); // bytes per frame
  header.setUint16(34, 16, true); // bits per sample
  ascii(36, "data");
  header.setUint32(40, samples.byteLength, true);
  const body = new DataView(new ArrayBuffer(samples.byteLength));
  samples.forEach((value, i) => body.setInt16(2 * i, value, true));
  return new Blob([header, body], { type: "audio/wav" });
}

function save(blob, name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

// The WAV is what was heard, as it arrived; the MP3 asks the server again with the same seed.
function downloadWav() {
  save(wavBlob(state.last.samples, SAMPLE_RATE), `cosyserve-${state.last.form.seed}.wav`);
}

async function downloadMp3() {
  clearError();
  say("Encoding MP3…");
  $("download-mp3").disabled = true;
  try {
    const [path, init] = speechRequest(state.last.form, "mp3");
    save(await (await api(path, init)).blob(), `cosyserve-${state.last.form.seed}.mp3`);
    say("MP3 saved.");
  } catch (error) {
    fail(error);
  } finally {
    setBusy(false);
  }
}

// -- adding a voice -----------------------------------------------------------------------------

async function addVoice(event) {
  event.preventDefault();
  clearError();
  const file = $("voice-file").files[0];
  const fields = new FormData();
  fields.set("name", $("voice-name").value.trim());
  if (file) fields.set("audio", file, file.name);
  else if (state.recording) fields.set("audio", state.recording.blob, state.recording.name);
  fields.set("transcript", $("transcript").value);
  say("Adding the voice…");
  try {
    const voice = await (await api("/v1/audio/voices", { method: "POST", body: fields })).json();
    await loadVoices(voice.name);
    say(`Voice ${voice.name} added.`);
  } catch (error) {
    fail(error);
  }
}

async function toggleRecording() {
  if (state.recorder !== null) {
    state.recorder.stop();
    return;
  }
  clearError();
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    fail(new Error("Recording needs a browser with MediaRecorder, on https or localhost."));
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    fail(new Error(`No microphone: ${error.message}`));
    return;
  }
  const recorder = new MediaRecorder(stream);
  const parts = [];
  const started = performance.now();
  recorder.ondataavailable = (event) => parts.push(event.data);
  recorder.onstop = () => {
    stream.getTracks().forEach((track) => track.stop());
    state.recorder = null;
    const type = recorder.mimeType;
    const extension = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "m4a" : "webm";
    state.recording = { blob: new Blob(parts, { type }), name: `recording.${extension}` };
    $("voice-file").value = ""; // the recording is now the voice's audio
    const preview = $("recording");
    if (preview.src) URL.revokeObjectURL(preview.src);
    preview.src = URL.createObjectURL(state.recording.blob);
    preview.hidden = false;
    $("record").textContent = "Record";
    $("record-state").textContent = `Recorded ${((performance.now() - started) / 1000).toFixed(1)} s.`;
  };
  recorder.start();
  state.recorder = recorder;
  $("record").textContent = "Stop recording";
  $("record-state").textContent = "Recording…";
}

// -- wiring -------------------------------------------------------------------------------------

function refreshVoices() {
  clearError();
  Promise.all([loadModels(), loadVoices()]).then(() => say(`${state.voices.length} voices.`), fail);
}

$("speak-form").addEventListener("submit", speak);
$("stop").addEventListener("click", stop);
$("text").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("speak-form").requestSubmit();
});
$("voice").addEventListener("change", () => updateModes(true));
$("mode").addEventListener("change", () => updateModes());
$("download-wav").addEventListener("click", downloadWav);
$("download-mp3").addEventListener("click", downloadMp3);
$("voice-form").addEventListener("submit", addVoice);
$("voice-file").addEventListener("change", () => {
  state.recording = null; // a chosen file replaces an earlier recording
  $("recording").hidden = true;
});
$("record").addEventListener("click", toggleRecording);
$("api-key").addEventListener("change", refreshVoices);
refreshVoices();
