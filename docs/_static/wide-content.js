// Marks code blocks and tables wider than the content column with the side that has
// more to see (te-more-right, te-more-left); wide-content.css draws a shadow there.
"use strict";
(() => {
  const SELECTOR = 'article[role="main"] pre, article[role="main"] .table-wrapper';

  function mark(block) {
    const hidden = block.scrollWidth - block.clientWidth;
    block.classList.toggle("te-more-left", hidden > 1 && block.scrollLeft > 1);
    block.classList.toggle("te-more-right", hidden > 1 && block.scrollLeft < hidden - 1);
  }

  function markAll() {
    document.querySelectorAll(SELECTOR).forEach(mark);
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll(SELECTOR).forEach((block) => {
      block.addEventListener("scroll", () => mark(block), { passive: true });
    });
    markAll();
    window.addEventListener("resize", markAll);
    // Web fonts change the width of the text once they arrive.
    if (document.fonts) document.fonts.ready.then(markAll);
  });
})();
