// Shared by the playground and the dashboard: the API key (asked for when the server wants
// one, kept in this browser's localStorage) and fetches that carry it.
"use strict";

const Tandem = (() => {
  const KEY = "tandem-api-key";
  let asking = null;
  let declined = false; // the user closed the dialog: polls stop asking until they ask

  function key() {
    return localStorage.getItem(KEY) || "";
  }

  function headers(extra = {}) {
    const h = { ...extra };
    if (key()) h.Authorization = `Bearer ${key()}`;
    return h;
  }

  // Show the key dialog; resolves once the user saved a key (or closed it: false).
  function askKey(message) {
    if (asking) return asking;
    const dialog = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    document.getElementById("key-message").textContent =
      message || "This server needs an API key (its --api-key).";
    input.value = key();
    asking = new Promise((resolve) => {
      dialog.onclose = () => {
        asking = null;
        if (dialog.returnValue === "save") {
          localStorage.setItem(KEY, input.value.trim());
          declined = false;
          resolve(true);
        } else {
          declined = true;
          resolve(false);
        }
      };
    });
    dialog.returnValue = ""; // Escape leaves it as it is: not a stale "save"
    dialog.showModal();
    input.focus();
    return asking;
  }

  // fetch() with the key; on 401 asks for a key and tries again while the user gives one.
  async function api(path, options = {}) {
    for (;;) {
      const opts = { ...options, headers: headers(options.headers || {}) };
      const resp = await fetch(path, opts);
      if (resp.status !== 401) return resp;
      if (declined) return resp;
      const msg = key() ? "That API key was refused; enter the server's key." : null;
      if (!(await askKey(msg))) return resp;
    }
  }

  // The message of an error body in OpenAI's shape, else the status line.
  async function errorText(resp) {
    try {
      const body = await resp.json();
      if (body && body.error) return body.error.message || JSON.stringify(body.error);
      return JSON.stringify(body);
    } catch (e) {
      return `${resp.status} ${resp.statusText}`;
    }
  }

  // The key dialog, the same on every page.
  function addKeyDialog() {
    const dialog = document.createElement("dialog");
    dialog.id = "key-dialog";
    dialog.innerHTML = `<form method="dialog">
        <p id="key-message"></p>
        <input id="key-input" type="password" autocomplete="off" placeholder="API key">
        <div class="buttons">
          <button type="button" value="cancel" class="ghost">Cancel</button>
          <button value="save" id="key-save">Save</button>
        </div>
      </form>`;
    // Cancel is no submit button: Enter in the field saves.
    dialog.querySelector("button[value=cancel]").addEventListener("click", () => {
      dialog.close("cancel");
    });
    document.body.append(dialog);
  }

  function wireHeader() {
    addKeyDialog();
    const button = document.getElementById("key-button");
    if (button) button.addEventListener("click", () => askKey("API key for this server."));
  }

  document.addEventListener("DOMContentLoaded", wireHeader);
  return { key, headers, askKey, api, errorText };
})();
