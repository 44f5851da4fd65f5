"""The synthetic task's sentence templates and word lists (``app.synthetic`` draws from them).

A template is a name, its operations (one character per step), a question and one solution line
per step. Placeholders: {name}, {friend}, {friend2} (distinct names); {he} {He} {him} {his} for
{name}; {item}/{items}, {box}/{boxes} (containers), {gift}; {a0}..{a3} operands; {v1}..{v3}
values. Names and objects are decoration: a problem's split is decided by template and operands.
"""

from __future__ import annotations

import typing


class Template(typing.NamedTuple):
  name: str
  ops: str  # one character per step
  question: str
  lines: tuple[str, ...]  # one per step; step i writes "{v<i>} op {a<i+1>} = {v<i+1>}" (v0 = a0)


# Placeholders: {name}, {friend}, {friend2} (distinct names); {he} {He} {him} {his} for {name};
# {item}/{items}, {box}/{boxes} (containers), {gift}; {a0}..{a3} operands; {v1}..{v3} values.
_T = Template
TEMPLATES = (
  # ---- 1 step
  _T("add_buy", "+", "{name} has {a0} {items}. {He} buys {a1} more. How many {items} does {he} "
     "have now?", ("{name} has {a0} + {a1} = {v1} {items} now.",)),
  _T("add_days", "+", "{name} collected {a0} {items} on Monday and {a1} on Tuesday. How many "
     "{items} did {he} collect in all?", ("{name} collected {a0} + {a1} = {v1} {items} in all.",)),
  _T("add_together", "+", "{name} has {a0} {items} and {friend} has {a1} {items}. How many {items}"
     " do they have together?", ("Together they have {a0} + {a1} = {v1} {items}.",)),
  _T("add_save", "+", "{name} saved ${a0} in May and ${a1} in June. How much money did {he} save "
     "in total?", ("{name} saved {a0} + {a1} = ${v1} in total.",)),
  _T("sub_give", "-", "{name} has {a0} {items}. {He} gives {a1} of them to {friend}. How many "
     "{items} does {he} have left?", ("{name} has {a0} - {a1} = {v1} {items} left.",)),
  _T("sub_sell", "-", "A shop has {a0} {items}. It sells {a1} of them. How many {items} are left?",
     ("The shop has {a0} - {a1} = {v1} {items} left.",)),
  _T("sub_spend", "-", "{name} has ${a0}. {He} spends ${a1} on a {gift}. How much money does {he}"
     " have left?", ("{name} has {a0} - {a1} = ${v1} left.",)),
  _T("sub_compare", "-", "{name} has {a0} {items}. {friend} has {a1} {items}. How many more "
     "{items} does {name} have than {friend}?", ("{name} has {a0} - {a1} = {v1} more {items}.",)),
  _T("sub_pages", "-", "A book has {a0} pages. {name} has read {a1} pages. How many pages are "
     "left?", ("There are {a0} - {a1} = {v1} pages left.",)),
  _T("mul_boxes", "*", "{name} buys {a0} {boxes} of {items}. Each {box} holds {a1} {items}. How "
     "many {items} does {he} buy?", ("{name} buys {a0} * {a1} = {v1} {items}.",)),
  _T("mul_price", "*", "One {item} costs ${a1}. {name} buys {a0} {items}. How much does {he} pay?",
     ("{name} pays {a0} * {a1} = ${v1}.",)),
  _T("mul_days", "*", "{name} reads {a1} pages every day. How many pages does {he} read in {a0} "
     "days?", ("{name} reads {a0} * {a1} = {v1} pages.",)),
  _T("mul_rows", "*", "There are {a0} rows of chairs with {a1} chairs in each row. How many chairs "
     "are there?", ("There are {a0} * {a1} = {v1} chairs.",)),
  _T("mul_times", "*", "{friend} has {a0} {items}. {name} has {a1} times as many. How many {items}"
     " does {name} have?", ("{name} has {a0} * {a1} = {v1} {items}.",)),
  _T("div_share", "/", "{name} has {a0} {items}. {He} shares them equally among {a1} friends. How "
     "many {items} does each friend get?", ("Each friend gets {a0} / {a1} = {v1} {items}.",)),
  _T("div_pack", "/", "{name} puts {a0} {items} into {boxes} of {a1}. How many {boxes} does {he} "
     "fill?", ("{name} fills {a0} / {a1} = {v1} {boxes}.",)),
  _T("div_price", "/", "{name} pays ${a0} for {a1} {items}. Each {item} costs the same. How much "
     "does one {item} cost?", ("One {item} costs {a0} / {a1} = ${v1}.",)),
  _T("div_days", "/", "{name} reads a {a0}-page book in {a1} days, the same number of pages each "
     "day. How many pages does {he} read each day?",
     ("{name} reads {a0} / {a1} = {v1} pages each day.",)),
  # ---- 2 steps
  _T("add_sub_give", "+-", "{name} has {a0} {items}. {He} buys {a1} more and then gives {a2} to "
     "{friend}. How many {items} does {he} have now?",
     ("After buying, {name} has {a0} + {a1} = {v1} {items}.",
      "After giving some away, {he} has {v1} - {a2} = {v2} {items}.")),
  _T("add_sub_basket", "+-", "There are {a0} {items} in a basket. {name} puts in {a1} more and "
     "{friend} takes out {a2}. How many {items} are in the basket now?",
     ("With {name}'s, there are {a0} + {a1} = {v1} {items}.",
      "Now there are {v1} - {a2} = {v2} {items} in the basket.")),
  _T("sub_add_shop", "-+", "A shop has {a0} {items}. It sells {a1} and then gets {a2} more. How "
     "many {items} does it have now?",
     ("After selling, the shop has {a0} - {a1} = {v1} {items}.",
      "Then it has {v1} + {a2} = {v2} {items}.")),
  _T("sub_add_lost", "-+", "{name} had {a0} {items}. {He} lost {a1} of them and then found {a2}. "
     "How many {items} does {he} have now?",
     ("After losing some, {name} had {a0} - {a1} = {v1} {items}.",
      "Now {he} has {v1} + {a2} = {v2} {items}.")),
  _T("add_add_days", "++", "{name} collected {a0} {items} on Monday, {a1} on Tuesday and {a2} on "
     "Wednesday. How many {items} did {he} collect in all?",
     ("On Monday and Tuesday {name} collected {a0} + {a1} = {v1} {items}.",
      "In all {he} collected {v1} + {a2} = {v2} {items}.")),
  _T("add_add_gifts", "++", "{name} has {a0} {items}. {friend} gives {him} {a1} and {friend2} "
     "gives {him} {a2}. How many {items} does {name} have now?",
     ("After {friend}'s gift, {name} has {a0} + {a1} = {v1} {items}.",
      "After {friend2}'s gift, {he} has {v1} + {a2} = {v2} {items}.")),
  _T("sub_sub_spend", "--", "{name} has ${a0}. {He} spends ${a1} on a {gift} and ${a2} on lunch. "
     "How much money does {he} have left?",
     ("After the {gift}, {name} has {a0} - {a1} = ${v1}.",
      "After lunch, {he} has {v1} - {a2} = ${v2} left.")),
  _T("sub_sub_bus", "--", "A bus has {a0} people on it. At the first stop {a1} people get off, and "
     "at the second stop {a2} more get off. How many people are on the bus now?",
     ("After the first stop, there are {a0} - {a1} = {v1} people.",
      "After the second stop, there are {v1} - {a2} = {v2} people on the bus.")),
  _T("mul_sub_boxes", "*-", "{name} buys {a0} {boxes} of {items} with {a1} {items} in each. {He} "
     "gives away {a2} {items}. How many {items} does {he} have left?",
     ("{name} buys {a0} * {a1} = {v1} {items}.",
      "{He} has {v1} - {a2} = {v2} {items} left.")),
  _T("mul_add_shop", "*+", "{name} buys {a0} {items} at ${a1} each and a {gift} for ${a2}. How "
     "much does {he} spend in total?",
     ("The {items} cost {a0} * {a1} = ${v1}.",
      "In total {name} spends {v1} + {a2} = ${v2}.")),
  _T("add_mul_boxes", "+*", "{name} has {a0} red {boxes} and {a1} blue {boxes}. Each {box} holds "
     "{a2} {items}. How many {items} are there in all?",
     ("{name} has {a0} + {a1} = {v1} {boxes}.",
      "They hold {v1} * {a2} = {v2} {items}.")),
  _T("add_div_share", "+/", "{name} has {a0} {items} and {friend} has {a1}. They share them all "
     "equally among {a2} kids. How many {items} does each kid get?",
     ("Together they have {a0} + {a1} = {v1} {items}.",
      "Each kid gets {v1} / {a2} = {v2} {items}.")),
  _T("sub_div_keep", "-/", "{name} has {a0} {items}. {He} keeps {a1} and shares the rest equally "
     "among {a2} friends. How many {items} does each friend get?",
     ("{name} shares {a0} - {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.")),
  _T("mul_div_share", "*/", "{name} buys {a0} {boxes} of {items} with {a1} in each {box}. {He} "
     "shares them equally among {a2} friends. How many {items} does each friend get?",
     ("{name} has {a0} * {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.")),
  _T("div_add_share", "/+", "{name} shares {a0} {items} equally among {a1} kids, one of them "
     "{friend}. {friend} already had {a2} {items}. How many {items} does {friend} have now?",
     ("Each kid gets {a0} / {a1} = {v1} {items}.",
      "{friend} has {v1} + {a2} = {v2} {items} now.")),
  _T("div_mul_price", "/*", "At a shop, {a1} {items} cost ${a0}. How much do {a2} {items} cost?",
     ("One {item} costs {a0} / {a1} = ${v1}.",
      "So {a2} {items} cost {v1} * {a2} = ${v2}.")),
  _T("mul_mul_read", "**", "{name} reads {a0} pages an hour. {He} reads {a1} hours a day for {a2} "
     "days. How many pages does {he} read?",
     ("{name} reads {a0} * {a1} = {v1} pages a day.",
      "In {a2} days {he} reads {v1} * {a2} = {v2} pages.")),
  _T("div_sub_box", "/-", "{name} splits {a0} {items} equally into {a1} {boxes}. Then {he} takes "
     "{a2} {items} out of one {box}. How many {items} are left in that {box}?",
     ("Each {box} has {a0} / {a1} = {v1} {items}.",
      "That {box} has {v1} - {a2} = {v2} {items} left.")),
  _T("sub_mul_packs", "-*", "A pack has {a0} {items}, but {a1} of them are damaged. How many good "
     "{items} are in {a2} packs?",
     ("Each pack has {a0} - {a1} = {v1} good {items}.",
      "So {a2} packs have {v1} * {a2} = {v2} good {items}.")),
  # ---- 3 steps
  _T("add_sub_sub", "+--", "{name} has {a0} {items}. {He} buys {a1} more, gives {a2} to {friend} "
     "and loses {a3}. How many {items} does {he} have left?",
     ("After buying, {name} has {a0} + {a1} = {v1} {items}.",
      "After giving some to {friend}, {he} has {v1} - {a2} = {v2} {items}.",
      "{He} has {v2} - {a3} = {v3} {items} left.")),
  _T("mul_sub_div", "*-/", "{name} buys {a0} {boxes} of {items} with {a1} in each. {He} keeps {a2}"
     " and shares the rest equally among {a3} friends. How many {items} does each friend get?",
     ("{name} buys {a0} * {a1} = {v1} {items}.",
      "{He} shares {v1} - {a2} = {v2} {items}.",
      "Each friend gets {v2} / {a3} = {v3} {items}.")),
  _T("mul_add_sub", "*+-", "{name} buys {a0} {items} at ${a1} each and a {gift} for ${a2}. {He} "
     "has a coupon for ${a3} off. How much does {he} pay?",
     ("The {items} cost {a0} * {a1} = ${v1}.",
      "With the {gift}, the total is {v1} + {a2} = ${v2}.",
      "With the coupon, {name} pays {v2} - {a3} = ${v3}.")),
  _T("add_add_div", "++/", "{name} has {a0} {items}, {friend} has {a1} and {friend2} has {a2}. "
     "They pack them all into {boxes} of {a3}. How many {boxes} do they fill?",
     ("{name} and {friend} have {a0} + {a1} = {v1} {items}.",
      "With {friend2}'s, they have {v1} + {a2} = {v2} {items}.",
      "They fill {v2} / {a3} = {v3} {boxes}.")),
  _T("div_mul_add", "/*+", "At a shop, {a1} {items} cost ${a0}. {name} buys {a2} {items} and a "
     "{gift} for ${a3}. How much does {he} spend?",
     ("One {item} costs {a0} / {a1} = ${v1}.",
      "So {a2} {items} cost {v1} * {a2} = ${v2}.",
      "In total {name} spends {v2} + {a3} = ${v3}.")),
  _T("sub_mul_add", "-*+", "A pack has {a0} {items}, but {a1} of them are damaged. {name} buys "
     "{a2} packs and already has {a3} good {items}. How many good {items} does {he} have now?",
     ("Each pack has {a0} - {a1} = {v1} good {items}.",
      "So {a2} packs have {v1} * {a2} = {v2} good {items}.",
      "{name} has {v2} + {a3} = {v3} good {items} now.")),
  _T("mul_mul_sub", "**-", "{name} earns ${a0} an hour. {He} works {a1} hours a day for {a2} days "
     "and then spends ${a3} on a {gift}. How much money does {he} have left?",
     ("{name} earns {a0} * {a1} = ${v1} a day.",
      "In {a2} days {he} earns {v1} * {a2} = ${v2}.",
      "After the {gift}, {he} has {v2} - {a3} = ${v3} left.")),
  _T("add_mul_sub", "+*-", "{name} has {a0} red {boxes} and {a1} blue {boxes} with {a2} {items} in"
     " each. {He} gives away {a3} {items}. How many {items} does {he} have left?",
     ("{name} has {a0} + {a1} = {v1} {boxes}.",
      "They hold {v1} * {a2} = {v2} {items}.",
      "{He} has {v2} - {a3} = {v3} {items} left.")),
  _T("sub_div_add", "-/+", "{name} keeps {a1} of {his} {a0} {items} and shares the rest equally "
     "among {a2} friends. {friend}, one of them, already had {a3}. How many {items} does {friend} "
     "have now?",
     ("{name} shares {a0} - {a1} = {v1} {items}.",
      "Each friend gets {v1} / {a2} = {v2} {items}.",
      "{friend} has {v2} + {a3} = {v3} {items} now.")),
  _T("add_add_add", "+++", "{name} collected {a0} {items} on Monday, {a1} on Tuesday, {a2} on "
     "Wednesday and {a3} on Thursday. How many {items} did {he} collect in all?",
     ("On Monday and Tuesday {name} collected {a0} + {a1} = {v1} {items}.",
      "With Wednesday's, that is {v1} + {a2} = {v2} {items}.",
      "In all {he} collected {v2} + {a3} = {v3} {items}.")),
  _T("sub_sub_sub", "---", "{name} has ${a0}. {He} spends ${a1} on a {gift}, ${a2} on lunch and "
     "${a3} on a bus ticket. How much money does {he} have left?",
     ("After the {gift}, {name} has {a0} - {a1} = ${v1}.",
      "After lunch, {he} has {v1} - {a2} = ${v2}.",
      "After the ticket, {he} has {v2} - {a3} = ${v3} left.")),
)
del _T
TEMPLATE_NAMES = tuple(t.name for t in TEMPLATES)
assert len(set(TEMPLATE_NAMES)) == len(TEMPLATE_NAMES)

NAMES = (
  ("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he"), ("Emma", "she"),
  ("Jack", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Max", "he"), ("Anna", "she"),
  ("Noah", "he"), ("Ella", "she"), ("Omar", "he"), ("Maria", "she"), ("Ravi", "he"),
  ("Grace", "she"), ("Luis", "he"), ("Nina", "she"), ("Kai", "he"), ("Sara", "she"),
  ("John", "he"), ("Amy", "she"),
)
PRONOUNS = {"he": ("he", "He", "him", "his"), "she": ("she", "She", "her", "her")}
ITEMS = (
  ("apple", "apples"), ("orange", "oranges"), ("pencil", "pencils"), ("sticker", "stickers"),
  ("marble", "marbles"), ("cookie", "cookies"), ("cupcake", "cupcakes"), ("card", "cards"),
  ("shell", "shells"), ("stamp", "stamps"), ("balloon", "balloons"), ("crayon", "crayons"),
  ("egg", "eggs"), ("flower", "flowers"), ("candy", "candies"), ("muffin", "muffins"),
  ("bead", "beads"), ("peach", "peaches"), ("button", "buttons"), ("lemon", "lemons"),
)
BOXES = (
  ("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars"), ("basket", "baskets"),
  ("tray", "trays"), ("crate", "crates"), ("bucket", "buckets"),
)
GIFTS = ("hat", "game", "kite", "ball", "scarf", "lamp", "puzzle", "backpack", "book", "toy")
