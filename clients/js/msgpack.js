// msgpack, what the protocol uses of it (maps, arrays, strings, integers, floats, bool, nil, bin): the
// client's second format, with no dependency.

const utf8 = new TextEncoder();
const fromUtf8 = new TextDecoder("utf-8", { fatal: true });

/** One value as msgpack bytes. Integers beyond 2⁵³ go as BigInt; `undefined` map values are left out
 * (as JSON.stringify does). */
export function encodeMsgpack(value) {
  const out = new Encoder();
  out.value(value);
  return out.bytes();
}

class Encoder {
  constructor() {
    this.buf = new Uint8Array(256);
    this.view = new DataView(this.buf.buffer);
    this.pos = 0;
  }

  bytes() {
    return this.buf.slice(0, this.pos);
  }

  room(n) {
    if (this.pos + n <= this.buf.length) return;
    const bigger = new Uint8Array(Math.max(this.buf.length * 2, this.pos + n));
    bigger.set(this.buf);
    this.buf = bigger;
    this.view = new DataView(bigger.buffer);
  }

  u8(...bytes) {
    this.room(bytes.length);
    for (const b of bytes) this.buf[this.pos++] = b;
  }

  put(kind, n, v) {
    this.room(n);
    this.view[kind](this.pos, v, false);
    this.pos += n;
  }

  head(n, fix, fixMax, c8, c16, c32) {
    if (n <= fixMax) this.u8(fix | n);
    else if (c8 !== null && n < 0x100) this.u8(c8, n);
    else if (n < 0x10000) {
      this.u8(c16);
      this.put("setUint16", 2, n);
    } else {
      this.u8(c32);
      this.put("setUint32", 4, n);
    }
  }

  integer(n) {
    // n: a safe Number integer or a BigInt.
    if (n >= 0) {
      if (n < 0x80) this.u8(Number(n));
      else if (n < 0x100) this.u8(0xcc, Number(n));
      else if (n < 0x10000) (this.u8(0xcd), this.put("setUint16", 2, Number(n)));
      else if (n < 0x100000000) (this.u8(0xce), this.put("setUint32", 4, Number(n)));
      else if (BigInt(n) < 1n << 64n) (this.u8(0xcf), this.put("setBigUint64", 8, BigInt(n)));
      else throw new RangeError("integer too large for msgpack");
    } else if (n >= -32) this.u8(0x100 + Number(n));
    else if (n >= -0x80) (this.u8(0xd0), this.put("setInt8", 1, Number(n)));
    else if (n >= -0x8000) (this.u8(0xd1), this.put("setInt16", 2, Number(n)));
    else if (n >= -0x80000000) (this.u8(0xd2), this.put("setInt32", 4, Number(n)));
    else if (BigInt(n) >= -(1n << 63n)) (this.u8(0xd3), this.put("setBigInt64", 8, BigInt(n)));
    else throw new RangeError("integer too small for msgpack");
  }

  value(v) {
    if (v === null || v === undefined) this.u8(0xc0);
    else if (v === false) this.u8(0xc2);
    else if (v === true) this.u8(0xc3);
    else if (typeof v === "bigint") this.integer(v);
    else if (typeof v === "number") {
      if (Number.isSafeInteger(v)) this.integer(v);
      else (this.u8(0xcb), this.put("setFloat64", 8, v));
    } else if (typeof v === "string") {
      const b = utf8.encode(v);
      this.head(b.length, 0xa0, 31, 0xd9, 0xda, 0xdb);
      this.raw(b);
    } else if (v instanceof Uint8Array || v instanceof ArrayBuffer) {
      const b = v instanceof Uint8Array ? v : new Uint8Array(v);
      this.head(b.length, 0, -1, 0xc4, 0xc5, 0xc6);
      this.raw(b);
    } else if (Array.isArray(v)) {
      this.head(v.length, 0x90, 15, null, 0xdc, 0xdd);
      for (const x of v) this.value(x);
    } else if (typeof v === "object") {
      const entries = Object.entries(v).filter(([, x]) => x !== undefined);
      this.head(entries.length, 0x80, 15, null, 0xde, 0xdf);
      for (const [k, x] of entries) {
        this.value(k);
        this.value(x);
      }
    } else throw new TypeError(`msgpack cannot encode a ${typeof v}`);
  }

  raw(b) {
    this.room(b.length);
    this.buf.set(b, this.pos);
    this.pos += b.length;
  }
}

/** Msgpack bytes as a value: maps as plain objects, bin as Uint8Array, 64-bit integers as Numbers when
 * they are safe integers and as BigInts when not. */
export function decodeMsgpack(bytes) {
  const b = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
  let pos = 0;
  const need = (n) => {
    if (pos + n > b.length) throw new RangeError("msgpack: truncated");
  };
  const num = (kind, n) => {
    need(n);
    const v = view[kind](pos, false);
    pos += n;
    return v;
  };
  const big = (v) => (v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v);
  const str = (n) => {
    need(n);
    const s = fromUtf8.decode(b.subarray(pos, pos + n));
    pos += n;
    return s;
  };
  const bin = (n) => {
    need(n);
    const s = b.slice(pos, pos + n);
    pos += n;
    return s;
  };
  const array = (n) => {
    const a = new Array(n);
    for (let i = 0; i < n; i++) a[i] = value();
    return a;
  };
  const map = (n) => {
    const o = {};
    for (let i = 0; i < n; i++) {
      const k = value();
      Object.defineProperty(o, String(k), { value: value(), enumerable: true, writable: true, configurable: true });
    }
    return o;
  };
  const value = () => {
    const c = num("getUint8", 1);
    if (c < 0x80) return c;
    if (c < 0x90) return map(c & 0x0f);
    if (c < 0xa0) return array(c & 0x0f);
    if (c < 0xc0) return str(c & 0x1f);
    if (c >= 0xe0) return c - 0x100;
    switch (c) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return bin(num("getUint8", 1));
      case 0xc5: return bin(num("getUint16", 2));
      case 0xc6: return bin(num("getUint32", 4));
      case 0xca: return num("getFloat32", 4);
      case 0xcb: return num("getFloat64", 8);
      case 0xcc: return num("getUint8", 1);
      case 0xcd: return num("getUint16", 2);
      case 0xce: return num("getUint32", 4);
      case 0xcf: return big(num("getBigUint64", 8));
      case 0xd0: return num("getInt8", 1);
      case 0xd1: return num("getInt16", 2);
      case 0xd2: return num("getInt32", 4);
      case 0xd3: return big(num("getBigInt64", 8));
      case 0xd9: return str(num("getUint8", 1));
      case 0xda: return str(num("getUint16", 2));
      case 0xdb: return str(num("getUint32", 4));
      case 0xdc: return array(num("getUint16", 2));
      case 0xdd: return array(num("getUint32", 4));
      case 0xde: return map(num("getUint16", 2));
      case 0xdf: return map(num("getUint32", 4));
      default: throw new RangeError(`msgpack: type 0x${c.toString(16)} is not used by the protocol`);
    }
  };
  const v = value();
  if (pos !== b.length) throw new RangeError("msgpack: bytes after the value");
  return v;
}
