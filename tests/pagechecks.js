// What tests/webtools.py looks at on a page: page.evaluate(this file, name) runs one check and returns
// what it found wrong (empty when all is well), each naming the element.
(name) => {
  const describe = (e) => {
    const id = e.id ? `#${e.id}` : "";
    const cls = typeof e.className === "string" && e.className.trim()
      ? `.${e.className.trim().split(/\s+/).join(".")}` : "";
    return `<${e.tagName.toLowerCase()}${id}${cls}> "${(e.textContent || "").trim().slice(0, 30)}"`;
  };
  const shown = (e) => {
    if (!e.checkVisibility({ visibilityProperty: true })) return false;
    const r = e.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) return false;
    // Behind an open modal dialog only the dialog counts.
    const modal = document.querySelector("dialog[open]");
    return !modal || modal.contains(e);
  };

  // Anything wider than the viewport, or the page scrolling sideways. What a scrolling box inside the
  // viewport holds (a wide table the reader scrolls on its own) is that box's to show, not the page's.
  const scrolledWithin = (e) => {
    for (let x = e.parentElement; x && x !== document.body; x = x.parentElement) {
      if (["auto", "scroll"].includes(getComputedStyle(x).overflowX)) return true;
    }
    return false;
  };
  const overflow = () => {
    const width = document.documentElement.clientWidth;
    const out = [];
    if (document.documentElement.scrollWidth > width) {
      out.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} > ${width}`);
    }
    for (const e of document.querySelectorAll("body *")) {
      if (e.closest(".sr-only") || !shown(e) || scrolledWithin(e)) continue;
      const r = e.getBoundingClientRect();
      if (r.left < -1 || r.right > width + 1) {
        out.push(`${describe(e)} spans ${Math.round(r.left)}..${Math.round(r.right)} of ${width}`);
      }
    }
    return out;
  };

  // WCAG 2 contrast of every visible text: relative luminance, backgrounds composited from the element
  // up to the root, the text's colour through every ancestor's opacity. Disabled controls are exempt.
  const contrast = () => {
    for (const a of document.getAnimations()) {
      try {
        a.finish();
      } catch {
        // an endless animation (a spinner)
      }
    }
    const parse = (c) => {
      const m = /rgba?\(([^)]+)\)/.exec(c);
      if (!m) return null;
      const p = m[1].split(/[\s,/]+/).filter(Boolean).map(Number);
      return { r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1 };
    };
    const over = (top, bottom) => ({
      r: top.r * top.a + bottom.r * (1 - top.a),
      g: top.g * top.a + bottom.g * (1 - top.a),
      b: top.b * top.a + bottom.b * (1 - top.a),
      a: 1,
    });
    const lum = (c) => {
      const f = (v) => ((v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
      return 0.2126 * f(c.r) + 0.7152 * f(c.g) + 0.0722 * f(c.b);
    };
    const background = (e) => {
      const layers = [];
      for (let x = e; x; x = x.parentElement) {
        const c = parse(getComputedStyle(x).backgroundColor);
        if (c && c.a > 0) {
          layers.push(c);
          if (c.a >= 1) break;
        }
        if (x.tagName === "DIALOG") break;
      }
      let bg = { r: 255, g: 255, b: 255, a: 1 };
      for (const c of layers.reverse()) bg = over(c, bg);
      return bg;
    };
    const failures = [];
    let checked = 0;
    for (const e of document.querySelectorAll("body *")) {
      const hasText = [...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
      if (!hasText || e.closest(".sr-only") || e.closest(":disabled") || !shown(e)) continue;
      const s = getComputedStyle(e);
      let alpha = 1;
      for (let x = e; x; x = x.parentElement) alpha *= Number(getComputedStyle(x).opacity);
      const fg = parse(s.color);
      const bg = background(e);
      const text = over({ ...fg, a: fg.a * alpha }, bg);
      const [hi, lo] = [lum(text), lum(bg)].sort((a, b) => b - a);
      const ratio = (hi + 0.05) / (lo + 0.05);
      const size = parseFloat(s.fontSize);
      const large = size >= 24 || (size >= 18.66 && Number(s.fontWeight) >= 700);
      const need = large ? 3 : 4.5;
      checked += 1;
      if (ratio < need) {
        const rgb = (c) => `rgb(${Math.round(c.r)}, ${Math.round(c.g)}, ${Math.round(c.b)})`;
        failures.push(`${describe(e)}: ${ratio.toFixed(2)}:1, needs ${need}:1 (${s.color} on ${rgb(bg)})`);
      }
    }
    return { checked, failures };
  };

  // A control a screen reader cannot name: no text, no aria-label, no label, no title.
  const unnamed = () => {
    const out = [];
    for (const e of document.querySelectorAll("button, input, select, textarea, a[href], [role=button]")) {
      if (!shown(e) || e.type === "hidden") continue;
      const named = e.getAttribute("aria-label") || e.getAttribute("aria-labelledby") ||
        (e.labels && e.labels.length) || (e.textContent || "").trim() || e.title;
      if (!named) out.push(describe(e));
    }
    return out;
  };

  // The focused element's outline, and whether the browser counts its focus as visible.
  const focusRing = () => {
    const e = document.activeElement;
    const s = getComputedStyle(e);
    return { element: describe(e), focusVisible: e.matches(":focus-visible"), style: s.outlineStyle,
      width: parseFloat(s.outlineWidth) };
  };

  return { overflow, contrast, unnamed, focusRing }[name]();
}
