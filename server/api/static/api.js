// Talking to the API: the bearer token typed into the page, and the API's own error messages.

export const $ = (id) => document.getElementById(id);

export function token() {
  return $("token").value.trim();
}

export function headers() {
  const h = { "Content-Type": "application/json" };
  if (token()) h.Authorization = `Bearer ${token()}`;
  return h;
}

/** The API's own message for a failed response: {"error": ...} (ours), {"error": {"message"}} (OpenAI's,
 * under /v1) or FastAPI's {"detail": ...}. */
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body.error) return typeof body.error === "string" ? body.error : body.error.message;
    if (body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status}: ${text.slice(0, 300)}`;
}

export async function get(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

export async function post(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

export function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}
