// AudioWorklet of bench/web/index.html: tells the page each time the agent's decoded track
// (after the browser's jitter buffer, as the <audio> element plays it) turns loud or quiet, with
// the context frame where it did, so gaps are counted in playout samples.
//
// processorOptions: threshold (RMS of samples in [-1, 1]; default the Python participant's
// int16 200), windowFrames (the window the RMS is taken over; 0: each 128-sample render
// quantum), sound (after an {arm: true} message, the first window above this RMS is posted as
// {sound: true, frame}).
const THRESHOLD = 200 / 32768; // the RMS the Python participant counts as speech (int16 200)

class EnergyProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options?.processorOptions ?? {};
    this.threshold = opts.threshold ?? THRESHOLD;
    this.windowFrames = opts.windowFrames || 0;
    this.sound = opts.sound ?? 1 / 32768;
    this.loud = false;
    this.armed = false;
    this.minRms = Infinity;
    this.sum = 0;
    this.count = 0;
    this.start = 0;
    this.port.onmessage = (e) => { if (e.data.arm) this.armed = true; };
  }

  decide(rms, frame) {
    if (this.armed && rms > this.sound) {
      this.armed = false;
      this.port.postMessage({ sound: true, frame });
    }
    const loud = rms > this.threshold;
    if (loud) this.minRms = Math.min(this.minRms, rms);
    if (loud !== this.loud) {
      this.loud = loud;
      const edge = { loud, frame };
      if (!loud) {
        edge.minRms = Number.isFinite(this.minRms) ? this.minRms : null;
        this.minRms = Infinity;
      }
      this.port.postMessage(edge);
    }
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    if (!this.windowFrames) {
      let sum = 0;
      for (let i = 0; i < channel.length; i++) sum += channel[i] * channel[i];
      this.decide(Math.sqrt(sum / channel.length), currentFrame);
      return true;
    }
    for (let i = 0; i < channel.length; i++) {  // windows of windowFrames across quanta
      if (this.count === 0) this.start = currentFrame + i;
      this.sum += channel[i] * channel[i];
      this.count += 1;
      if (this.count === this.windowFrames) {
        this.decide(Math.sqrt(this.sum / this.count), this.start);
        this.sum = 0;
        this.count = 0;
      }
    }
    return true;
  }
}

registerProcessor("energy", EnergyProcessor);
