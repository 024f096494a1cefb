// The model card tab: GET /models/{id}/card (rendered by the server, raw HTML escaped) with its images
// fetched like every other call, with the token, so a protected server shows them too.

import { get } from "./api.js";

let imageUrls = [];

export async function showCard(container, modelId) {
  const html = await (await get(`/models/${encodeURIComponent(modelId)}/card`)).text();
  const card = new DOMParser().parseFromString(html, "text/html"); // inert: nothing loads or runs here
  const own = `/models/${encodeURIComponent(modelId)}/card/`;
  const urls = await Promise.all([...card.images].map(async (img) => {
    if (!img.getAttribute("src").startsWith(own)) { // the page stays offline: no image from elsewhere
      img.replaceWith(img.alt);
      return null;
    }
    const url = URL.createObjectURL(await (await get(img.getAttribute("src"))).blob());
    img.src = url;
    return url;
  }));
  for (const url of imageUrls) URL.revokeObjectURL(url);
  imageUrls = urls.filter(Boolean);
  container.replaceChildren(...card.body.childNodes);
}
