//! The packing loops' tile transposed into a panel: `tile[l][s]` (line `l`, step `s`) written to
//! `block[s * width + l]`, each step's lines contiguous.
//!
//! The k-contiguous packing loops ([`super::pack`]) convert each line's run of steps into a row of a
//! tile (contiguous, so the conversion vectorises), then write the tile into the panel step by step.
//! Element by element that transposition was about half of the packing's time, and a product's A and
//! B are both packed this way when both lie contiguous along `k` (a Linear's forward: rows of `x`, and
//! the weight `(out, in)` read transposed). On AVX-512 the 4-byte elements (f32 values, bf16 pairs)
//! are moved in zmm registers instead: a 6-line panel (the register kernels' A) 8 steps at a time by
//! two permutes per 16 elements, a panel of a multiple of 16 lines (their B) in 16 x 16 blocks by the
//! usual four rounds of shuffles; on AVX2 in ymm registers, in 8 x 8 blocks. Only data moves: every
//! version writes the same bits (`tests/vector_widths.rs` runs the packing capped at AVX2 and at the
//! baseline, and compares). Where the operand already holds the panel's words (f32 for f32 compute,
//! bf16 pairs), or a register load converts it into them (f32 rounded to a half type, a half type
//! widened: [`super::row_load`], in ymm registers), and the panel is whole, its blocks are transposed
//! from where they lie ([`transpose_rows`]), with no copy into the tile: measured on a Zen 4, 2
//! threads, bf16 2048^3 (A read in place) 337-395 -> 401-413 GFLOP/s, BERT-base's FFN-down forward
//! (both) +4-5% in two runs of three, the main job's forward product (`W^T` read in place) +1-6%.

use super::pack::PackInto;
use super::row_load::Load;

/// Writes `tile[l][s]` to `block[s * width + l]` for `l < lines` and `s < steps`; the lines from
/// `lines` to `width` of each step are left as they are.
///
/// `tile` holds at least `width` rows, those from `lines` on all zero (the packing's tile starts zeroed
/// and only its first `lines` rows are written), so the zmm versions may move whole groups of lines.
#[inline(always)]
pub(crate) fn transpose<P: PackInto, const CHUNK: usize>(
    tile: &[[P; CHUNK]],
    lines: usize,
    steps: usize,
    width: usize,
    block: &mut [P],
) {
    debug_assert!(lines <= width && width <= tile.len() && steps <= CHUNK && block.len() >= steps * width);
    let done = in_registers(tile, steps, width, block);
    for (s, row) in block.chunks_exact_mut(width).enumerate().take(steps).skip(done) {
        for (out, line) in row.iter_mut().zip(&tile[..lines]) {
            *out = line[s];
        }
    }
}

/// The leading steps the vector versions can do (all of them but a tail), or none; returns how many.
#[inline(always)]
fn in_registers<P: PackInto, const CHUNK: usize>(
    tile: &[[P; CHUNK]],
    steps: usize,
    width: usize,
    block: &mut [P],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if size_of::<P>() == 4 {
        let (src, dst) = (tile.as_ptr().cast::<u8>(), block.as_mut_ptr().cast::<u32>());
        // SAFETY: the tile has at least `width` rows of CHUNK >= `steps` words, the block `steps *
        // width` words (`transpose`'s assertion); `P` is 4 bytes, every bit pattern valid (`PackInto`).
        return unsafe { x86::leading_steps(src, 4 * CHUNK, Load::Words, steps, width, dst) };
    }
    let _ = (tile, steps, width, block);
    0
}

/// [`transpose`] of `width` full lines read where they lie and converted by `load` on the way: line
/// `l`'s steps are the elements from `src + l * row` bytes (`load.source_bytes()` each). Returns false
/// where no vector version runs or one leaves a tail of steps: the caller then writes the whole block
/// through its tile (over any leading steps written here).
///
/// # Safety
/// `src` is valid for reading `width` rows of `steps` elements, `row` bytes apart, and 4-byte aligned
/// for [`Load::Words`]; `block` holds at least `steps * width` words.
#[inline(always)]
pub(crate) unsafe fn transpose_rows<P: PackInto>(
    src: *const u8,
    row: usize,
    load: Load,
    steps: usize,
    width: usize,
    block: &mut [P],
) -> bool {
    debug_assert!(block.len() >= steps * width);
    #[cfg(target_arch = "x86_64")]
    if size_of::<P>() == 4 {
        // SAFETY: as the caller guarantees; `P` is 4 bytes, every bit pattern valid (`PackInto`).
        return unsafe { x86::leading_steps(src, row, load, steps, width, block.as_mut_ptr().cast()) }
            == steps;
    }
    let _ = (src, row, load, steps, width, block);
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::row_load::x86::{Bf16ToF32, Eight, F16ToF32, F32ToBf16, F32ToF16, Words};
    use super::Load;

    /// The leading steps of `width` rows (`row` bytes apart from `src`), converted by `load`, written
    /// into the panel by the widest register version the CPU and the vectorisation cap allow: plain
    /// words in zmm for 6 lines and multiples of 16, in ymm for 6 lines and multiples of 8; converted
    /// ones in ymm ([`super::super::row_load`]). Returns how many (0 where none applies).
    ///
    /// # Safety
    /// `src` valid for reading `width` rows of `steps` elements, `row` bytes apart (4-byte aligned for
    /// plain words); `dst` for writing `steps * width` words.
    #[inline(always)]
    pub(super) unsafe fn leading_steps(
        src: *const u8,
        row: usize,
        load: Load,
        steps: usize,
        width: usize,
        dst: *mut u32,
    ) -> usize {
        if load == Load::Words && crate::vectorise::allows(crate::Isa::Avx512) {
            let (words, row) = (src.cast::<u32>(), row / 4);
            if width == 6 {
                let done = steps / 8 * 8;
                // SAFETY: AVX-512 F is available; rows and output as the caller guarantees.
                unsafe { six_lines(words, row, done, dst) };
                return done;
            }
            if width.is_multiple_of(16) {
                let done = steps / 16 * 16;
                // SAFETY: as above.
                unsafe { sixteens(words, row, width, done, dst) };
                return done;
            }
        }
        if !(crate::vectorise::allows(crate::Isa::Avx2) && (width == 6 || width.is_multiple_of(8))) {
            return 0;
        }
        let done = steps / 8 * 8;
        let step = load.source_bytes();
        // SAFETY (each call): AVX2 and F16C are available (`Isa::Avx2`); as above.
        unsafe {
            match load {
                Load::Words => eights::<Words>(src, row, step, width, done, dst),
                Load::F32ToBf16 => eights::<F32ToBf16>(src, row, step, width, done, dst),
                Load::F32ToF16 => eights::<F32ToF16>(src, row, step, width, done, dst),
                Load::Bf16ToF32 => eights::<Bf16ToF32>(src, row, step, width, done, dst),
                Load::F16ToF32 => eights::<F16ToF32>(src, row, step, width, done, dst),
            }
        }
        done
    }

    /// Output word `16 q + i` of an 8-step group of a 6-line panel is step `s = j / 6` of line
    /// `l = j % 6` (`j = 16 q + i`). Lines 0-3 come from the pair of registers holding lines 0 | 1 and
    /// 2 | 3 (8 steps each), at `8 l + s`; lines 4 and 5 from the third register, at `8 (l - 4) + s`,
    /// under a mask.
    const fn six_line_tables() -> ([[u32; 16]; 3], [[u32; 16]; 3], [u16; 3]) {
        let (mut low, mut high, mut masks) = ([[0u32; 16]; 3], [[0u32; 16]; 3], [0u16; 3]);
        let mut j = 0;
        while j < 48 {
            let (q, i, s, l) = (j / 16, j % 16, (j / 6) as u32, (j % 6) as u32);
            if l < 4 {
                low[q][i] = 8 * l + s;
            } else {
                high[q][i] = 8 * (l - 4) + s;
                masks[q] |= 1 << i;
            }
            j += 1;
        }
        (low, high, masks)
    }

    const SIX: ([[u32; 16]; 3], [[u32; 16]; 3], [u16; 3]) = six_line_tables();

    /// Two rows of 8 words, `row` words apart from `at`, as the low and high halves of one register.
    ///
    /// # Safety
    /// AVX-512 F; both rows readable.
    #[inline(always)]
    unsafe fn two_rows(at: *const u32, row: usize) -> __m512i {
        // SAFETY: the caller's guarantee.
        unsafe {
            let low = _mm256_loadu_si256(at.cast());
            let high = _mm256_loadu_si256(at.add(row).cast());
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
        }
    }

    /// [`super::transpose`] of a 6-line tile for `steps` (a multiple of 8) steps.
    ///
    /// # Safety
    /// AVX-512 F; `tile` holds 6 rows of at least `steps` words, `row` words apart; `out` is valid for
    /// writing `6 * steps` words.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn six_lines(tile: *const u32, row: usize, steps: usize, out: *mut u32) {
        let (low_table, high_table, masks) = SIX;
        // SAFETY: the tables are 16 words each; rows and output as the caller guarantees.
        unsafe {
            let (mut low, mut high) = ([_mm512_setzero_si512(); 3], [_mm512_setzero_si512(); 3]);
            for q in 0..3 {
                low[q] = _mm512_loadu_si512(low_table[q].as_ptr().cast());
                high[q] = _mm512_loadu_si512(high_table[q].as_ptr().cast());
            }
            for s0 in (0..steps).step_by(8) {
                let lines_01 = two_rows(tile.add(s0), row);
                let lines_23 = two_rows(tile.add(2 * row + s0), row);
                let lines_45 = two_rows(tile.add(4 * row + s0), row);
                for q in 0..3 {
                    let v = _mm512_permutex2var_epi32(lines_01, low[q], lines_23);
                    let v = _mm512_mask_permutexvar_epi32(v, masks[q], high[q], lines_45);
                    _mm512_storeu_si512(out.add(6 * s0 + 16 * q).cast(), v);
                }
            }
        }
    }

    /// [`super::transpose`] of a tile of `width` (a multiple of 16) lines for `steps` (a multiple of 16)
    /// steps, in 16 x 16 blocks.
    ///
    /// # Safety
    /// AVX-512 F; `tile` holds `width` rows of at least `steps` words, `row` words apart; `out` is valid
    /// for writing `width * steps` words.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sixteens(tile: *const u32, row: usize, width: usize, steps: usize, out: *mut u32) {
        for l0 in (0..width).step_by(16) {
            for s0 in (0..steps).step_by(16) {
                // SAFETY: rows l0..l0 + 16 and steps s0..s0 + 16 lie in the tile, and the 16 output rows'
                // words l0..l0 + 16 in `out`, as the caller guarantees.
                unsafe {
                    let mut rows = [_mm512_setzero_si512(); 16];
                    for (i, r) in rows.iter_mut().enumerate() {
                        *r = _mm512_loadu_si512(tile.add((l0 + i) * row + s0).cast());
                    }
                    let columns = block_16x16(rows);
                    for (j, column) in columns.into_iter().enumerate() {
                        _mm512_storeu_si512(out.add((s0 + j) * width + l0).cast(), column);
                    }
                }
            }
        }
    }

    /// [`super::transpose`] in ymm registers of a tile of 6 lines or of a multiple of 8, for `steps` (a
    /// multiple of 8) steps, in 8 x 8 blocks (a 6-line tile's two missing rows zero, each step's first 6
    /// words stored); each row's eight elements (`step` bytes each) loaded and converted by `E`.
    ///
    /// # Safety
    /// AVX2 and F16C; `tile` holds `width` rows of at least `steps` elements, `row` bytes apart; `out` is
    /// valid for writing `width * steps` words.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn eights<E: Eight>(
        tile: *const u8,
        row: usize,
        step: usize,
        width: usize,
        steps: usize,
        out: *mut u32,
    ) {
        for l0 in (0..width).step_by(8) {
            for s0 in (0..steps).step_by(8) {
                // SAFETY: rows l0..min(l0 + 8, width) and steps s0..s0 + 8 lie in the tile, the output
                // rows' words l0..l0 + 8 (6 for a 6-line tile) in `out`, as the caller guarantees.
                unsafe {
                    let mut rows = [_mm256_setzero_si256(); 8];
                    for (i, r) in rows.iter_mut().enumerate().take(width.min(8)) {
                        *r = E::load(tile.add((l0 + i) * row + s0 * step));
                    }
                    let columns = block_8x8(rows);
                    for (j, column) in columns.into_iter().enumerate() {
                        let at = out.add((s0 + j) * width + l0);
                        if width == 6 {
                            _mm_storeu_si128(at.cast(), _mm256_castsi256_si128(column));
                            _mm_storel_epi64(at.add(4).cast(), _mm256_extracti128_si256::<1>(column));
                        } else {
                            _mm256_storeu_si256(at.cast(), column);
                        }
                    }
                }
            }
        }
    }

    /// The 8 x 8 transpose of 32-bit words (as [`block_16x16`], with one round of lane shuffles).
    #[inline(always)]
    fn block_8x8(rows: [__m256i; 8]) -> [__m256i; 8] {
        // SAFETY (every intrinsic below): AVX2, which the `target_feature` caller enables; register
        // operations only.
        unsafe {
            let mut words = [_mm256_setzero_si256(); 8];
            for i in (0..8).step_by(2) {
                words[i] = _mm256_unpacklo_epi32(rows[i], rows[i + 1]);
                words[i + 1] = _mm256_unpackhi_epi32(rows[i], rows[i + 1]);
            }
            let mut quads = [_mm256_setzero_si256(); 8];
            for i in (0..8).step_by(4) {
                quads[i] = _mm256_unpacklo_epi64(words[i], words[i + 2]);
                quads[i + 1] = _mm256_unpackhi_epi64(words[i], words[i + 2]);
                quads[i + 2] = _mm256_unpacklo_epi64(words[i + 1], words[i + 3]);
                quads[i + 3] = _mm256_unpackhi_epi64(words[i + 1], words[i + 3]);
            }
            let mut columns = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                columns[j] = _mm256_permute2x128_si256::<0x20>(quads[j], quads[4 + j]);
                columns[4 + j] = _mm256_permute2x128_si256::<0x31>(quads[j], quads[4 + j]);
            }
            columns
        }
    }

    /// The 16 x 16 transpose of 32-bit words: word `c` of the result's register `r` is word `r` of
    /// `rows[c]`. 32-bit then 64-bit interleaves within 128-bit lanes (after which lane `k` of register
    /// `4 i + j` holds word `4 k + j` of rows `4 i .. 4 i + 3`), then two rounds of lane shuffles.
    #[inline(always)]
    fn block_16x16(rows: [__m512i; 16]) -> [__m512i; 16] {
        // SAFETY (every intrinsic below): AVX-512 F, which the `target_feature` callers enable; register
        // operations only.
        unsafe {
            let mut words = [_mm512_setzero_si512(); 16];
            for i in (0..16).step_by(2) {
                words[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
                words[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
            }
            let mut quads = [_mm512_setzero_si512(); 16];
            for i in (0..16).step_by(4) {
                quads[i] = _mm512_unpacklo_epi64(words[i], words[i + 2]);
                quads[i + 1] = _mm512_unpackhi_epi64(words[i], words[i + 2]);
                quads[i + 2] = _mm512_unpacklo_epi64(words[i + 1], words[i + 3]);
                quads[i + 3] = _mm512_unpackhi_epi64(words[i + 1], words[i + 3]);
            }
            let mut columns = [_mm512_setzero_si512(); 16];
            for j in 0..4 {
                // Lanes 0-1 and 2-3 of quads j and 4 + j, and of 8 + j and 12 + j.
                let low_01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(quads[j], quads[4 + j]);
                let low_23 = _mm512_shuffle_i32x4::<0b01_00_01_00>(quads[8 + j], quads[12 + j]);
                let high_01 = _mm512_shuffle_i32x4::<0b11_10_11_10>(quads[j], quads[4 + j]);
                let high_23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(quads[8 + j], quads[12 + j]);
                columns[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(low_01, low_23);
                columns[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(low_01, low_23);
                columns[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(high_01, high_23);
                columns[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(high_01, high_23);
            }
            columns
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: usize = 64;

    /// A tile of `width` rows (the first `lines` numbered, the rest zero, as the packing leaves them)
    /// and what the element-by-element transposition writes into a panel prefilled with a marker.
    fn case(lines: usize, width: usize, steps: usize) -> (Vec<[u32; CHUNK]>, Vec<u32>) {
        let mut tile = vec![[0u32; CHUNK]; width.max(6)];
        for (l, row) in tile.iter_mut().enumerate().take(lines) {
            for (s, v) in row.iter_mut().enumerate() {
                *v = (l as u32) << 16 | s as u32 | 0x8000_0000;
            }
        }
        let mut want = vec![0u32; steps * width];
        for s in 0..steps {
            for l in 0..lines {
                want[s * width + l] = tile[l][s];
            }
        }
        (tile, want)
    }

    #[test]
    fn every_version_writes_the_element_by_element_panel() {
        for (lines, width) in
            [(6, 6), (4, 6), (16, 16), (11, 16), (64, 64), (37, 64), (24, 24), (8, 8), (5, 7)]
        {
            for steps in [0, 1, 7, 8, 9, 15, 16, 17, 33, 64] {
                let (tile, want) = case(lines, width, steps);
                let mut got = vec![0u32; steps * width];
                transpose(&tile, lines, steps, width, &mut got);
                assert_eq!(got, want, "lines {lines}, width {width}, steps {steps}");
                if lines == width {
                    // The same lines where they lie, 3 words apart beyond their steps.
                    let row = steps + 3;
                    let mut src = vec![u32::MAX; width * row];
                    for (l, line) in tile.iter().enumerate().take(width) {
                        src[l * row..][..steps].copy_from_slice(&line[..steps]);
                    }
                    let mut direct = vec![0u32; steps * width];
                    // SAFETY: `src` holds `width` rows of `steps` words, `row` apart; the panel
                    // `steps * width` words.
                    let (at, bytes) = (src.as_ptr().cast(), 4 * row);
                    if unsafe { transpose_rows(at, bytes, Load::Words, steps, width, &mut direct) } {
                        assert_eq!(direct, want, "in place: width {width}, steps {steps}");
                    }
                }
                #[cfg(target_arch = "x86_64")]
                {
                    use crate::gemm::row_load::x86::Words;
                    let (src, bytes) = (tile.as_ptr().cast::<u32>(), tile.as_ptr().cast::<u8>());
                    let mut direct = vec![0u32; steps * width];
                    let dst = direct.as_mut_ptr();
                    let (eight, sixteen) = (steps / 8 * 8, steps / 16 * 16);
                    if crate::Isa::Avx2.is_supported() && (width == 6 || width % 8 == 0) {
                        // SAFETY: AVX2 present; the tile has `width` rows of CHUNK words, the panel
                        // `steps * width` words.
                        unsafe { x86::eights::<Words>(bytes, 4 * CHUNK, 4, width, eight, dst) };
                        assert_eq!(
                            direct[..eight * width],
                            want[..eight * width],
                            "ymm: {lines}/{width}/{steps}"
                        );
                    }
                    if crate::Isa::Avx512.is_supported() && width == 6 {
                        direct.fill(0);
                        // SAFETY: AVX-512 present; as above.
                        unsafe { x86::six_lines(src, CHUNK, eight, dst) };
                        assert_eq!(direct[..eight * 6], want[..eight * 6], "zmm six: {lines}/{steps}");
                    }
                    if crate::Isa::Avx512.is_supported() && width % 16 == 0 {
                        direct.fill(0);
                        // SAFETY: AVX-512 present; as above.
                        unsafe { x86::sixteens(src, CHUNK, width, sixteen, dst) };
                        assert_eq!(
                            direct[..sixteen * width],
                            want[..sixteen * width],
                            "zmm: {lines}/{width}/{steps}"
                        );
                    }
                }
            }
        }
    }
}
